"""Every relative link in the README and the docs resolves: the file exists inside the
repository, and a `#anchor` names a heading of its target (GitHub's slug of it). Moving text
between documents changes relative paths and headings; this fails with the file, the line and
the link, so a move cannot leave a dead link behind. The README links only the repository's own
files."""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = sorted(["README.md", "CONTRIBUTING.md",
               *(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))])

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(path: str, keep_code: bool = False):
    """(line number, text) of the lines outside fenced code blocks, with inline code removed
    unless `keep_code` (a heading's inline code is part of its slug)."""
    with open(os.path.join(ROOT, path)) as f:
        fenced = False
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                yield number, line if keep_code else INLINE_CODE.sub("", line)


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in _prose_lines(path, keep_code=True):
        match = HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def links(path: str):
    for number, line in _prose_lines(path):
        for match in LINK.finditer(line):
            yield number, match.group(1)


def test_slugs_follow_github():
    assert _slug("Keeping a stage's replicas together: AsyncSPARTA or SparseLoCo") == \
        "keeping-a-stages-replicas-together-asyncsparta-or-sparseloco"
    assert _slug("Measured: scripts/bench_trust.py") == "measured-scriptsbench_trustpy"
    assert _slug("agora-node --help") == "agora-node---help"


@pytest.mark.parametrize("path", DOCS)
def test_relative_links_resolve(path):
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            if path == "README.md":
                problems.append(f"{path}:{number}: {target} (the README links only the repository's files)")
            continue
        file_part, _, anchor = target.partition("#")
        if file_part:
            resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), file_part))
            if os.path.relpath(resolved, ROOT).startswith(".."):
                problems.append(f"{path}:{number}: {target} points outside the repository")
                continue
            if not os.path.exists(resolved):
                problems.append(f"{path}:{number}: {target}: no such file")
                continue
        else:
            resolved = os.path.join(ROOT, path)
        if anchor and resolved.endswith(".md") and anchor not in anchors(os.path.relpath(resolved, ROOT)):
            problems.append(f"{path}:{number}: {target}: no heading with anchor #{anchor}")
    assert not problems, "dead links:\n" + "\n".join(problems)
