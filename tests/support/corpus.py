"""Corpora the data tests make, in every input format `agora-node data prepare` reads."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

from roles.trainer.data import SyntheticCorpus


def documents(count: int, seed: int = 0, prefix: str = "") -> list[str]:
    """`count` distinct documents of the synthetic grammar (numbered, so none repeats)."""
    corpus = SyntheticCorpus(seed).iter_text()
    return [f"{prefix}{i}: {text}" for i, text in zip(range(count), corpus)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> None:
    data = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor(level=3).compress(data)
    path.write_bytes(data)


def write_parquet(path: Path, docs: list[str], column: str = "text") -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: docs, "id": list(range(len(docs)))}), path, row_group_size=500)


def write_saved_dataset(path: Path, docs: list[str], split: str = "train") -> None:
    import datasets

    datasets.DatasetDict({split: datasets.Dataset.from_dict({"text": docs})}).save_to_disk(str(path))


def every_kind(root: Path, per_kind: int) -> tuple[list[str], list[Path]]:
    """One input of each kind under `root`; returns all documents and the inputs to name."""
    made = itertools.count()
    kinds = [("a.txt", None), ("b.jsonl", write_jsonl), ("c.jsonl.gz", write_jsonl), ("d.jsonl.zst", write_jsonl),
             ("e.parquet", write_parquet), ("saved", write_saved_dataset)]
    all_docs: list[str] = []
    inputs: list[Path] = []
    for name, writer in kinds:
        docs = documents(1 if writer is None else per_kind, seed=next(made), prefix=f"{name} ")
        path = root / name
        if writer is None:
            path.write_text(docs[0])
        else:
            writer(path, docs)
        all_docs += docs
        inputs.append(path)
    return all_docs, inputs
