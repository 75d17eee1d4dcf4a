"""Layers point one way: protocol/ imports nothing of ours, corpus/ (data) builds on protocol/,
roles/ on both, authorizer/ on those, node/ (the CLI and process code) on everything. A new import against the
grain fails here with the file and line (docs/architecture.md, 'Layers')."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLOWED = {
    "protocol": {"protocol"},
    "corpus": {"protocol", "corpus"},
    "roles": {"protocol", "corpus", "roles"},
    "authorizer": {"protocol", "corpus", "roles", "authorizer"},
    "node": {"protocol", "corpus", "roles", "authorizer", "node"},
}


def _imports(path: str):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def test_imports_follow_the_layers():
    wrong = []
    for package, allowed in ALLOWED.items():
        for directory, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                for line, module in _imports(path):
                    top = module.split(".")[0]
                    if top in ALLOWED and top not in allowed:
                        wrong.append(f"{os.path.relpath(path, ROOT)}:{line} imports {module}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)
