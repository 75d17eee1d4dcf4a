#!/usr/bin/env python3
"""Rewrite the generated blocks of the documentation from the code: the `--help` blocks in
docs/cli.md, and the policy-file schema and the self-termination rules in docs/operations.md.
tests/unit/test_docs_in_sync.py fails when they differ, so the documents cannot drift from the code.

    .venv/bin/python scripts/sync_docs.py          # rewrite the blocks
    .venv/bin/python scripts/sync_docs.py --check  # exit 1 if anything would change
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import typing
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = "100"


def help_text(*args: str) -> str:
    env = {**os.environ, "COLUMNS": WIDTH, "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=120)
    if result.returncode != 0:
        raise SystemExit(f"agora-node {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return "```\n" + result.stdout.rstrip() + "\n```\n"


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (list, dict, typing.Union) or type(annotation).__name__ == "UnionType":
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner = ", ".join(_type_name(a) for a in args)
        if origin is list:
            return f"list of {inner}"
        if origin is dict:
            return f"map {inner}"
        return f"{inner} or null"
    return getattr(annotation, "__name__", str(annotation))


def _model_table(model, prefix: str = "") -> list[str]:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    rows = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(_model_table(annotation, f"{prefix}{name}."))
            continue
        if field.default_factory is not None:
            default = f"`{field.default_factory()!r}`"
        else:
            default = "from the run config" if field.default is PydanticUndefined else f"`{field.default!r}`"
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | {_type_name(annotation)} | {default} | {description} |")
    return rows


def policy_schema() -> str:
    sys.path.insert(0, ROOT)
    from authorizer.policy import HardwareFloor, Policy

    lines = ["| field | type | default | meaning |", "|---|---|---|---|", *_model_table(Policy), "",
             "Each entry of `floors` (keys `head`, `body`, `tail`, `trainer`) has these fields:", "",
             "| field | type | default | meaning |", "|---|---|---|---|", *_model_table(HardwareFloor)]
    return "\n".join(lines) + "\n"


def termination_rules() -> str:
    sys.path.insert(0, ROOT)
    from roles.worker.health.termination import rules_table

    return rules_table()


BLOCKS: dict[tuple[str, str], Callable[[], str]] = {
    ("docs/cli.md", "help:node"): lambda: help_text("--help"),
    ("docs/cli.md", "help:authorizer"): lambda: help_text("--role", "authorizer", "--help"),
    ("docs/operations.md", "policy-schema"): policy_schema,
    ("docs/operations.md", "termination-rules"): termination_rules,
}


def block_pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- {re.escape(name)} -->\n)(.*?)(<!-- /{re.escape(name)} -->)", re.DOTALL)


def synced(path: str, text: str) -> str:
    for (file, name), render in BLOCKS.items():
        if file != path:
            continue
        pattern = block_pattern(name)
        if not pattern.search(text):
            raise SystemExit(f"{file} has no <!-- {name} --> block")
        body = render()
        text = pattern.sub(lambda m: m.group(1) + body + m.group(3), text)
    return text


def main() -> int:
    changed = []
    for path in sorted({file for file, _ in BLOCKS}):
        full = os.path.join(ROOT, path)
        with open(full) as f:
            current = f.read()
        updated = synced(path, current)
        if updated != current:
            changed.append(path)
            if "--check" not in sys.argv[1:]:
                with open(full + ".tmp", "w") as f:
                    f.write(updated)
                os.replace(full + ".tmp", full)
    if changed:
        print(("out of date: " if "--check" in sys.argv[1:] else "updated: ") + ", ".join(changed))
    return 1 if changed and "--check" in sys.argv[1:] else 0


if __name__ == "__main__":
    sys.exit(main())
