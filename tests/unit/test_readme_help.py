"""The README shows `agora-node --help` and `agora-node --role authorizer --help` verbatim;
regenerate them with scripts/sync_readme_help.py after changing a setting."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sync_module():
    spec = importlib.util.spec_from_file_location("sync_readme_help", os.path.join(ROOT, "scripts",
                                                                                   "sync_readme_help.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_help_blocks_match_the_commands():
    sync = _sync_module()
    with open(sync.README) as f:
        readme = f.read()
    for name, args in sync.BLOCKS.items():
        match = sync.block_pattern(name).search(readme)
        assert match is not None, f"README.md lacks the <!-- help:{name} --> block"
        assert match.group(2) == sync.help_text(args), (
            f"README.md's `agora-node {' '.join(args)}` block is out of date: run scripts/sync_readme_help.py")
