"""A small real-text corpus from documentation already on this machine, for benchmarks and tests
that need text other than the synthetic grammar and must not download any.

Writes one `corpus.jsonl` (`{"text", "source", "license"}` per line) that `agora-node data
prepare` reads, of about `--mb` megabytes, from two kinds of text, in this order:

1. the long descriptions (`METADATA`: the README on PyPI) of the Python distributions installed
   beside this interpreter whose metadata names an open-source license (SPDX expression, license
   field or OSI classifier; others are skipped), by distribution name;
2. then, while the corpus is short of `--mb`, the changelogs of the Debian packages under
   `/usr/share/doc` (`changelog*`, gzipped or not) that ship a `copyright` file stating their
   terms (each line names it; packages without one are left out), at most `PER_FILE_BYTES` of
   each, packages in an order fixed by a hash of their names so a small corpus mixes many.

Long texts are cut at blank lines into documents of about `DOCUMENT_BYTES`, so prepare's held-out
choice (a hash per document) spreads over every source, and the documents chosen are written in
the order of their hashes: prepare cuts shards in input order and a trainer reads a shard's
samples before the next shard's, so a corpus written source by source would train on one kind of
text at a time. The same installed files give the same bytes. Then prepare it, e.g. for
bench_fidelity's two trainers (which need two training shards):

    python scripts/make_text_corpus.py --out /tmp/text --mb 3
    agora-node data prepare /tmp/text/corpus.jsonl --output /tmp/text-4096 --train-tokenizer 4096 \\
        --shard-tokens 16384 --heldout-fraction 0.05

Prints one JSON line (documents, bytes, by source kind) on stdout.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

DOCUMENT_BYTES = 8_000
PER_FILE_BYTES = 64_000
"""At most this much of one changelog: a few long ones must not make up the corpus."""
DOC_ROOT = Path("/usr/share/doc")

_OPEN_LICENSES = re.compile(
    r"\b(MIT|BSD|Apache|ISC|PSF|Python Software Foundation|MPL|Mozilla Public|LGPL|GPL|Unlicense|CC0|Zlib|"
    r"HPND|0BSD|Artistic|EPL|Eclipse Public|OSI Approved)\b", re.IGNORECASE)


def package_license(metadata) -> Optional[str]:
    """The open-source license a distribution's metadata names, or None (unknown or proprietary)."""
    expression = (metadata.get("License-Expression") or "").strip()
    field = (metadata.get("License") or "").strip().splitlines()
    classifiers = [c.split("::")[-1].strip() for c in metadata.get_all("Classifier") or []
                   if c.startswith("License :: OSI Approved")]
    for candidate in (expression, field[0] if field else "", *classifiers):
        if candidate and _OPEN_LICENSES.search(candidate) and "proprietary" not in candidate.lower():
            return candidate[:80]
    return None


def split_text(text: str, size: int = DOCUMENT_BYTES) -> list[str]:
    """`text` cut at blank lines into pieces of about `size` characters (a longer paragraph stays whole)."""
    pieces: list[str] = []
    current: list[str] = []
    length = 0
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = paragraph.strip("\n")
        if not paragraph.strip():
            continue
        if current and length + len(paragraph) > size:
            pieces.append("\n\n".join(current))
            current, length = [], 0
        current.append(paragraph)
        length += len(paragraph) + 2
    if current:
        pieces.append("\n\n".join(current))
    return pieces


def package_descriptions(site_packages: Optional[list[str]] = None) -> Iterator[dict]:
    """Long descriptions of the installed distributions with an open-source license, by name."""
    import importlib.metadata

    paths = site_packages or [sysconfig.get_paths()["purelib"]]
    seen: dict[str, tuple[str, str]] = {}
    for dist in importlib.metadata.distributions(path=paths):
        name = (dist.metadata.get("Name") or "").strip()
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        license_name = package_license(dist.metadata)
        if not name or not body.strip() or license_name is None or name.lower() in seen:
            continue
        seen[name.lower()] = (body, license_name)
    for key in sorted(seen):
        body, license_name = seen[key]
        for piece in split_text(body):
            yield {"text": piece, "source": f"pypi:{key}", "license": license_name}


def _read_changelog(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return raw[:PER_FILE_BYTES].decode("utf-8", errors="replace")


def debian_changelogs(root: Path = DOC_ROOT) -> Iterator[dict]:
    """Changelogs of the packages documented under `root`, in an order fixed by their names' hashes."""
    if not root.is_dir():
        return
    packages = sorted((p for p in root.iterdir() if p.is_dir() and not p.is_symlink()),
                      key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
    for package in packages:
        copyright_file = package / "copyright"
        if not copyright_file.is_file():
            continue  # no stated terms: leave it out
        for path in sorted(package.glob("changelog*")):
            if not path.is_file() or path.suffix not in ("", ".gz"):
                continue
            try:
                text = _read_changelog(path)
            except (OSError, EOFError, gzip.BadGzipFile):
                continue
            for piece in split_text(text):
                yield {"text": piece, "source": f"debian:{package.name}/{path.name}",
                       "license": f"see {copyright_file}"}


def make_text_corpus(out: Path, mb: float, *, site_packages: Optional[list[str]] = None,
                     doc_root: Path = DOC_ROOT) -> dict:
    """Write `out/corpus.jsonl` of about `mb` megabytes of text; returns what it holds."""
    out.mkdir(parents=True, exist_ok=True)
    budget = int(mb * 1e6)
    written = 0
    counts: dict[str, dict[str, int]] = {}
    chosen: list[tuple[str, str]] = []
    for kind, documents in (("pypi", package_descriptions(site_packages)), ("debian", debian_changelogs(doc_root))):
        for document in documents:
            if written >= budget:
                break
            line = json.dumps(document, sort_keys=True, ensure_ascii=False)
            chosen.append((hashlib.sha256(line.encode("utf-8")).hexdigest(), line))
            size = len(document["text"].encode("utf-8"))
            written += size
            entry = counts.setdefault(kind, {"documents": 0, "bytes": 0})
            entry["documents"] += 1
            entry["bytes"] += size
    path = out / "corpus.jsonl"
    tmp = out / ".corpus.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for _, line in sorted(chosen))
    tmp.replace(path)
    return {"path": str(path), "bytes": written, "documents": sum(c["documents"] for c in counts.values()),
            "by_source": counts, "short_of_target": written < budget}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="where corpus.jsonl goes")
    p.add_argument("--mb", type=float, default=3.0, metavar="N", help="megabytes of text, about (default 3)")
    p.add_argument("--doc-root", type=Path, default=DOC_ROOT, metavar="DIR",
                   help=f"where package documentation lies (default {DOC_ROOT})")
    args = p.parse_args(argv)
    if args.mb <= 0:
        p.error("--mb must be positive")
    result = make_text_corpus(args.out, args.mb, doc_root=args.doc_root)
    print(json.dumps(result))
    if result["short_of_target"]:
        print(f"only {result['bytes'] / 1e6:.2f} MB of text found", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
