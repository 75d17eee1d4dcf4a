"""Generated blocks of the documentation match the code: docs/cli.md shows `agora-node --help`
and `agora-node --role authorizer --help` verbatim, docs/operations.md every policy field.
Regenerate them with scripts/sync_docs.py after changing a setting."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sync_module():
    spec = importlib.util.spec_from_file_location("sync_docs", os.path.join(ROOT, "scripts", "sync_docs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SYNC = _sync_module()


@pytest.mark.parametrize("path, name", list(SYNC.BLOCKS))
def test_generated_block_matches_the_code(path, name):
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    match = SYNC.block_pattern(name).search(text)
    assert match is not None, f"{path} lacks the <!-- {name} --> block"
    assert match.group(2) == SYNC.BLOCKS[(path, name)](), f"{path} block {name} is out of date: run scripts/sync_docs.py"
