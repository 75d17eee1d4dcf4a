"""Every phase of a node can be stopped, and nothing outlives it: real agora-node processes get a
signal in each phase (bootstrap, admission retry, admission queue, state download, weight sync,
active, draining) and must be gone within 2 s with every child, socket, segment and temp file; a
worker killed with SIGKILL leaves no process behind within 5 s and is serving again with the same
command and identity. Plus the checks that run before joining (duplicate identity, whose error
exit leaves nothing behind either; trainer data; the memory plan)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from node.lifecycle import shared_memory_files
from tests.support.faults_node import faults_prefix
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

NODE = [sys.executable, "-m", "node.cli"]
UNREACHABLE_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWCunTGJkLV1GNMN5XCGpwkoiLJZ7vxKnuDpsCffWu6Xr3"
SIGNAL_TO_EXIT_S = 2.0
TWO_STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]
measured: dict[str, float] = {}
"""Signal-to-exit times and the like, printed at the end of the module (run with -s to see them)."""


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if measured:
        print("\nlifecycle timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in measured.items()))


CLEANUP_GRACE_S = 10.0


class Tree:
    """A node's process tree and what it holds outside its memory, noted while it runs."""

    def __init__(self, pid: int):
        self.pid = pid
        self.processes: dict[int, float] = {}
        self.sockets: dict[str, str] = {}
        """Unix socket path -> the process that had it open, for the failure message."""
        self.names_by_pid: dict[int, str] = {}
        self.note()

    @property
    def described(self) -> str:
        return ", ".join(f"{pid} {name}" + (" (the node)" if pid == self.pid else "")
                         for pid, name in self.names_by_pid.items())

    def note(self) -> "Tree":
        try:
            root = psutil.Process(self.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.Error:
            return self
        for process in family:
            try:
                self.processes.setdefault(process.pid, process.create_time())
                self.names_by_pid.setdefault(process.pid, " ".join(process.cmdline()[:3])[:80] or process.name())
                for c in process.net_connections(kind="unix"):
                    if isinstance(c.laddr, str) and c.laddr.startswith(tempfile.gettempdir()):
                        self.sockets.setdefault(c.laddr, f"of pid {process.pid} ({process.name()})")
            except psutil.Error:
                continue
        return self

    def names(self) -> list[str]:
        names = []
        for pid in self.processes:
            try:
                names.append(psutil.Process(pid).name())
            except psutil.Error:
                pass
        return names

    def alive(self) -> list[psutil.Process]:
        alive = []
        for pid, created in self.processes.items():
            try:
                process = psutil.Process(pid)
                if abs(process.create_time() - created) < 0.01 and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except psutil.Error:
                continue
        return alive

    def leftovers(self) -> list[str]:
        left = []
        for process in self.alive():
            try:
                left.append(f"pid {process.pid} ({process.name()}, child of {process.ppid()})")
            except psutil.Error:
                continue
        left += [f"{path} {owner}" for path, owner in self.sockets.items() if os.path.exists(path)]
        # the private directories some sockets live in: multiprocessing's pymp-*, torch_shm_manager's
        left += sorted({os.path.dirname(path) for path in self.sockets
                        if os.path.dirname(path) != tempfile.gettempdir() and os.path.isdir(os.path.dirname(path))})
        for pid, created in self.processes.items():  # segments an earlier process of the same pid leaked are not ours
            left += shared_memory_files([pid], born_after=created)
        left += glob.glob(os.path.join(tempfile.gettempdir(), f"agora-trust-{self.pid}-*"))
        return left

    def wait_clean(self, timeout_s: float, what: str) -> float:
        """Seconds until nothing of the tree is left. `timeout_s` is what a quiet machine needs;
        on a loaded one the watchdog may take longer, so only what stays CLEANUP_GRACE_S longer fails."""
        started = time.monotonic()
        try:
            poll_until(lambda: not self.leftovers(), timeout_s + CLEANUP_GRACE_S, f"{what} to leave nothing behind")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; left: {self.leftovers()}; the tree was {self.described}") from None
        took = time.monotonic() - started
        if took > timeout_s:
            print(f"{what}: the tree's leftovers took {took:.1f} s to go (more than {timeout_s} s)")
        return took


def _log_has(node, text: str) -> bool:
    return text in node.log_tail(400)


def _wait_for_process(pid: int, name: str, timeout_s: float = 30.0) -> None:
    def present():
        try:
            return any(p.name() == name for p in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            return False

    poll_until(present, timeout_s, f"a {name} process under {pid}")


def _check_signal_exit(node, phase: str, sig=signal.SIGTERM, expected_code: int = 0) -> None:
    tree = Tree(node.pid)
    started = time.monotonic()
    node.proc.send_signal(sig)
    try:
        code = node.proc.wait(10)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{phase}: still running 10 s after {sig.name}:\n{node.log_tail()}") from None
    took = time.monotonic() - started
    measured[phase] = took
    assert code == expected_code, f"{phase}: exit {code}\n{node.log_tail()}"
    assert took <= SIGNAL_TO_EXIT_S, f"{phase}: exited {took:.2f}s after {sig.name}\n{node.log_tail()}"
    tree.wait_clean(5, phase)
    assert "Traceback" not in node.log_tail(400), node.log_tail(400)


@pytest.mark.timeout(120)
def test_signal_while_bootstrapping_and_retrying_admission(make_swarm, run_config_path):
    swarm = make_swarm(run_config_path())
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never completes a handshake
    peer = UNREACHABLE_PEER.replace("/tcp/9/", f"/tcp/{silent.getsockname()[1]}/")
    booting = swarm.start("worker", stage=0, wait_ready=False,
                          args=["--initial-peers", peer, "--bootstrap-timeout-s", "60"])
    retrying = swarm.start("trainer", wait_ready=False, args=["--authorizer", "http://127.0.0.1:9"])
    _wait_for_process(booting.pid, "p2pd")
    poll_until(lambda: _log_has(retrying, "retrying"), 60, "the trainer to retry the dead authorizer")
    _check_signal_exit(booting, "bootstrap")
    _check_signal_exit(retrying, "admission retry", signal.SIGINT)
    silent.close()


@pytest.mark.timeout(150)
def test_signal_while_active_and_while_draining(make_swarm, run_config_path):
    swarm = make_swarm(run_config_path())
    first = swarm.start("worker", stage=0)
    second = swarm.start("worker", stage=1)
    _check_signal_exit(second, "active")
    # A second signal while the first worker drains: killed at once, exit 130.
    tree = Tree(first.pid)
    started = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    poll_until(lambda: _log_has(first, "stopping"), 5, "the worker to start draining")
    first.proc.send_signal(signal.SIGTERM)
    code = first.proc.wait(10)
    measured["draining, second signal"] = time.monotonic() - started
    assert code == 130, first.log_tail()
    assert measured["draining, second signal"] <= SIGNAL_TO_EXIT_S
    tree.wait_clean(5, "draining")


@pytest.mark.timeout(150)
def test_signal_while_downloading_state_and_while_in_weight_sync(make_swarm, run_config_path):
    # A joiner loads state and syncs only once its stage has stepped: two stages and a trainer.
    # Stage 0's state (80,512 parameters and their AdamW moments, about 1 MB) goes in 16 chunks of
    # 64 KiB, two at a time, and its first replica pauses 1 s before each, so a download lasts 8 s
    # (20 s over agora/v1/state's 4096-value chunks); a joiner without state lags by more than
    # max_stale_steps and stays in weight sync for the whole test.
    config = run_config_path(stages=TWO_STAGES, target_batch_size=4,
                             sync={"max_stale_steps": 1, "weight_sync_steps": 10_000, "state_chunk_elements": 4096,
                                   "state_chunk_bytes": 1 << 16})
    swarm = make_swarm(config)
    first = swarm.start("worker", stage=0, prefix=faults_prefix(state_chunk_delay_s=1))
    tail = swarm.start("worker", stage=1, wait_ready=False)
    trainer = swarm.start("trainer", wait_ready=False, args=["--lanes", "2", "--discovery-period-s", "1"])
    swarm.wait_ready(tail)
    swarm.wait_ready(trainer)
    poll_until(lambda: _log_has(first, "stage 0 step 2:"), 90, "stage 0 to step past max_stale_steps")
    assert swarm.stop(trainer) == 0  # the stage keeps its step; the joiners get the two cores

    downloading = swarm.start("worker", stage=0, wait_ready=False, name="downloading")
    syncing = swarm.start("worker", stage=0, wait_ready=False, args=["--state-source", "none"], name="syncing")
    poll_until(lambda: _log_has(downloading, "loading stage 0 state:"), 60, "the joiner's download to be under way")
    _check_signal_exit(downloading, "state download")
    assert not _log_has(downloading, "joined stage"), downloading.log_tail()

    swarm.wait_ready(syncing)
    assert _log_has(syncing, "joined stage 0 in weight_sync"), syncing.log_tail()
    _check_signal_exit(syncing, "weight sync", signal.SIGINT)
    assert not _log_has(syncing, "sync phase weight_sync ->"), syncing.log_tail()


@pytest.mark.timeout(180)
def test_sigkill_leaves_nothing_and_the_same_command_serves_again(make_swarm, run_config_path, tmp_path):
    swarm = make_swarm(run_config_path())
    swarm.start("worker", stage=0)
    key = str(tmp_path / "victim.key")
    victim = swarm.start("worker", stage=1, args=["--identity", key], name="victim")
    tree = Tree(victim.pid)
    poll_until(lambda: "p2pd" in tree.note().names() and len(tree.note().sockets) >= 2, 20,
               "the victim's children and sockets")
    os.kill(victim.pid, signal.SIGKILL)  # the node only, as the OOM killer would
    victim.proc.wait(5)
    measured["SIGKILL cleanup"] = tree.wait_clean(5, "a SIGKILLed worker")

    started = time.monotonic()
    again = swarm.start("worker", stage=1, args=["--identity", key], name="victim-again", timeout_s=30)
    measured["restart to serving"] = time.monotonic() - started
    assert again.peer_id == victim.peer_id
    assert measured["restart to serving"] <= 30

    # Duplicates of the live one: its port, its key file, its key under another file name.
    port = again.maddrs[0].split("/tcp/")[1].split("/")[0]
    copy = str(tmp_path / "copy.key")
    shutil.copy(key, copy)
    cases = [
        (["--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"], f"tcp port {port}"),
        (["--identity", key], "duplicate identity"),
        # The same key under another file name: refused by the duplicate check once the copy is in
        # the DHT; when the initial peer dials our peer id back and reaches the live node instead,
        # the copy cannot join at all, and the error says a duplicate identity may be why.
        (["--identity", copy], ("already live in the run", "another process already runs with this identity")),
    ]
    for args, fragments in cases:
        fragments = (fragments,) if isinstance(fragments, str) else fragments
        duplicate = swarm.start("worker", stage=1, args=args, wait_ready=False, name=f"duplicate-{len(swarm.nodes)}")
        tree = Tree(duplicate.pid)  # noted until it exits: an error exit leaves nothing behind either
        try:
            poll_until(lambda: tree.note() and duplicate.proc.poll() is not None, 60, f"{duplicate.name} to exit")
        except AssertionError as exc:  # once beside other tests (the copied key): say where it got to
            raise AssertionError(f"{exc}; its log:\n{duplicate.log_tail(40)}") from None
        code = duplicate.proc.returncode
        errors = [line for line in duplicate.log_tail(400).splitlines() if line.startswith("agora-node: error:")]
        assert code == 2 and len(errors) == 1 and any(f in errors[0] for f in fragments), duplicate.log_tail()
        assert "Traceback" not in duplicate.log_tail(400)
        tree.wait_clean(5, duplicate.name)
    assert again.proc.poll() is None, "a refused duplicate must not disturb the live node"


@pytest.mark.parametrize("content, fragment", [
    (None, "does not exist"),
    ("", "is empty"),
    ("a few words", "too few for shard 1 of 2"),
])
def test_trainer_data_is_checked_before_joining(tmp_path, content, fragment):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_text(content)
    # An unreachable initial peer: reaching the bootstrap at all would mean the check came too late.
    result = subprocess.run(NODE + ["--role", "trainer", "--config", "tiny", "--insecure-open-run", "--data", str(path),
                                    "--shard-index", "1", "--num-shards", "2", "--initial-peers", UNREACHABLE_PEER],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("agora-node: error:")]
    assert len(errors) == 1 and fragment in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_dry_run_exit_code_says_whether_it_fits_on_a_card_that_is_not_here():
    # --host-memory: the stage's optimizer needs about 19 GiB of host RAM, which this machine may
    # or may not have free; the test is about the card.
    base = NODE + ["--role", "worker", "--config", "8b", "--stage", "3", "--dry-run", "--device", "cuda",
                   "--gpu-memory", "24GiB", "--host-memory", "64GiB"]
    fits = subprocess.run(base + ["--max-batch", "1"], capture_output=True, text=True, timeout=60)
    assert fits.returncode == 0, fits.stderr
    assert "24.00 GiB" in fits.stdout and "fits" in fits.stdout
    too_big = subprocess.run(base + ["--max-batch", "64"], capture_output=True, text=True, timeout=60)
    assert too_big.returncode == 2, too_big.stderr
    errors = [line for line in too_big.stderr.splitlines() if line.startswith("agora-node: error:")]
    assert len(errors) == 1 and "--max-batch 2" in errors[0], too_big.stderr
    assert "Traceback" not in too_big.stderr
    small_host = subprocess.run(base + ["--max-batch", "1", "--host-memory", "8GiB"], capture_output=True, text=True,
                                timeout=60)
    assert small_host.returncode == 2 and "8.00 GiB host RAM" in small_host.stderr, small_host.stderr
    # Without --max-batch the plan sizes the batch: half of what the 8B stage's weights leave free
    # of 80 GiB holds five samples of 4,096 tokens; 24 GiB holds one.
    for card, batch in (("80GiB", 5), ("24GiB", 1)):
        sized = subprocess.run([a if a != "24GiB" else card for a in base], capture_output=True, text=True, timeout=60)
        assert sized.returncode == 0 and f"max batch {batch}\n" in sized.stdout, (sized.stdout, sized.stderr)
        assert f"coalesces up to {batch} sample(s)" in sized.stderr
    not_dry = subprocess.run([a for a in base if a != "--dry-run"], capture_output=True, text=True, timeout=60)
    assert not_dry.returncode == 2 and "--host-memory" in not_dry.stderr, not_dry.stderr


@pytest.mark.timeout(120)
def test_signal_while_queued_frees_the_slot(make_swarm, run_config_path, tmp_path):
    import httpx

    admin = "lifecycle-admin-token-0123456789"
    swarm = make_swarm(None)
    authorizer = swarm.start_authorizer([
        "--run-config", run_config_path(), "--data-dir", str(tmp_path / "authorizer"), "--port", "0",
        "--admin-token", admin, "--trainer-capacity", "4", "--join-rate", "0.001", "--join-burst", "1", "--checks", "capability,integrity"])
    # The one token of the bucket admits the first trainer; the second waits in the queue.
    swarm.start("trainer", args=["--authorizer", authorizer.url, "--account-token", "first"])
    queued = swarm.start("trainer", wait_ready=False, args=["--authorizer", authorizer.url, "--account-token", "q"])
    poll_until(lambda: _log_has(queued, "queue position"), 60, "the trainer to wait in the queue")

    def statuses() -> list[str]:
        reply = httpx.get(f"{authorizer.url}/v1/admin/participants", headers={"Authorization": f"Bearer {admin}"},
                          timeout=10)
        reply.raise_for_status()
        return [p["status"] for p in reply.json()["participants"]]

    assert sorted(statuses()) == ["admitted", "queued"]
    _check_signal_exit(queued, "admission queue")
    poll_until(lambda: "queued" not in statuses(), 5, "the authorizer to free the queued slot")
