"""Layers point one way: protocol/ imports nothing of ours, corpus/ (data) builds on protocol/,
roles/ on both, authorizer/ on those, node/ (the CLI and process code) on everything. A new import against the
grain fails here with the file and line (docs/architecture.md, 'Layers').

Within the worker (roles/worker/), its rooms point one way too: health, state and steps build only
on the worker's base modules (errors.py, layout.py, config.py, evidence_reports.py), averaging on health, serving on
steps, SparseLoCo on health, steps and serving, and only role.py on everything
(roles/worker/__init__.py)."""

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


WORKER = "roles.worker"
WORKER_BASE = {"errors", "layout", "config", "evidence_reports"}
"""The worker's own modules every room may import."""
ROOMS = {
    "health": set(),
    "state": set(),
    "steps": set(),
    "averaging": {"health"},
    "serving": {"steps"},
    "sparseloco": {"health", "steps", "serving"},
}
"""Room -> the other rooms it may import (besides itself and the base)."""


def _room(module: str) -> str | None:
    """The room or base module `module` (roles.worker.X...) is in; None outside the worker."""
    parts = module.split(".")
    if parts[:2] != ["roles", "worker"] or len(parts) < 3:
        return None
    return parts[2]


def _worker_imports(path: str):
    """`_imports`, with `from roles.worker import X` read as an import of roles.worker.X."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == WORKER and node.level == 0:
            for alias in node.names:
                yield node.lineno, f"{WORKER}.{alias.name}"
    yield from _imports(path)


def test_worker_rooms_import_one_way():
    wrong = []
    root = os.path.join(ROOT, "roles", "worker")
    for room, allowed in ROOMS.items():
        for directory, _, files in os.walk(os.path.join(root, room)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                for line, module in _worker_imports(path):
                    target = _room(module)
                    if target is None or target == room or target in WORKER_BASE or target in allowed:
                        continue
                    wrong.append(f"{os.path.relpath(path, ROOT)}:{line} imports {module} "
                                 f"(roles/worker/{room}/ may import {sorted(allowed | WORKER_BASE) or 'only the base'})")
    assert not wrong, "imports against the worker's rooms (roles/worker/__init__.py):\n" + "\n".join(wrong)


def test_every_worker_module_is_in_a_room_or_the_base():
    """A new module lands in a room or is the role's own; a new room gets a place in ROOMS."""
    root = os.path.join(ROOT, "roles", "worker")
    loose = []
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "__init__.py")):
            if entry not in ROOMS:
                loose.append(f"roles/worker/{entry}/ is a room test_layers.py does not know")
        elif entry.endswith(".py") and entry[:-3] not in WORKER_BASE | {"__init__", "role"}:
            loose.append(f"roles/worker/{entry} is neither in a room nor the role's own")
    assert not loose, "\n".join(loose)


WORKER_MODULE_LINES_MAX = 500
"""The worker is split into rooms so that a newcomer can read one module at a time: one that
outgrows this is a second concept waiting for a module of its own."""


def test_no_worker_module_outgrows_a_sitting():
    long = []
    for folder, _, files in os.walk(os.path.join(ROOT, "roles", "worker")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    lines = sum(1 for _ in f)
                if lines > WORKER_MODULE_LINES_MAX:
                    long.append(f"{os.path.relpath(path, ROOT)}: {lines} lines")
    assert not long, f"worker modules over {WORKER_MODULE_LINES_MAX} lines: {long}"
