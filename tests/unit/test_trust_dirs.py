"""A node that starts removes the trust directories that dead nodes left behind, and only those."""

import os
import subprocess
import sys

from node.trust import TRUST_DIR_PREFIX, remove_dead_nodes_trust_dirs, trust_dir_prefix


def test_only_dead_nodes_directories_are_removed(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{trust_dir_prefix(gone.pid)}abc"
    alive = tmp_path / f"{trust_dir_prefix(os.getpid())}def"
    other = tmp_path / f"{TRUST_DIR_PREFIX}honest-0-plain-xyz"  # a benchmark's work directory
    for path in (dead, alive, other):
        path.mkdir()
        (path / "credential.msgpack").write_bytes(b"x")
    assert remove_dead_nodes_trust_dirs(str(tmp_path)) == 1
    assert not dead.exists() and alive.exists() and other.exists()
    assert remove_dead_nodes_trust_dirs(str(tmp_path)) == 0
