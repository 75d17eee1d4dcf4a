#!/usr/bin/env python3
"""Rewrite the README's `--help` blocks from the real command (tests/unit/test_readme_help.py
fails when they differ, so the README's synopsis cannot drift from the code).

    .venv/bin/python scripts/sync_readme_help.py          # rewrite README.md
    .venv/bin/python scripts/sync_readme_help.py --check  # exit 1 if it would change
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BLOCKS = {
    "node": ["--help"],
    "authorizer": ["--role", "authorizer", "--help"],
}
WIDTH = "100"


def help_text(args: list[str]) -> str:
    env = {**os.environ, "COLUMNS": WIDTH, "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=120)
    if result.returncode != 0:
        raise SystemExit(f"agora-node {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result.stdout.rstrip() + "\n"


def block_pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- help:{name} -->\n```\n)(.*?)(```\n<!-- /help:{name} -->)", re.DOTALL)


def synced(readme: str) -> str:
    for name, args in BLOCKS.items():
        pattern = block_pattern(name)
        if not pattern.search(readme):
            raise SystemExit(f"README.md has no <!-- help:{name} --> block")
        text = help_text(args)
        readme = pattern.sub(lambda m: m.group(1) + text + m.group(3), readme)
    return readme


def main() -> int:
    with open(README) as f:
        current = f.read()
    updated = synced(current)
    if "--check" in sys.argv[1:]:
        return 0 if updated == current else 1
    if updated != current:
        with open(README + ".tmp", "w") as f:
            f.write(updated)
        os.replace(README + ".tmp", README)
        print("README.md updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
