"""`agora-node data prepare` as users run it: every input kind, a trained tokenizer, a killed
preparation continued, a finished one left alone, and bad input refused in one sentence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.corpus import documents, every_kind, write_jsonl, write_parquet
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration


def _data(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "node.cli", "data", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def _prepared(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _texts(out: Path, split: str) -> list[str]:
    """The documents a split's shards hold, decoded."""
    from roles.trainer.tokenizer import load_tokenizer

    manifest = _prepared(out)
    entry = manifest["tokenizer"]
    tokenizer = load_tokenizer(str(out / entry["file"]) if entry["file"] else None)
    shards = [np.load(out / s["file"]) for s in manifest["splits"][split]["shards"]]
    assert all(len(a) == s["tokens"] for a, s in zip(shards, manifest["splits"][split]["shards"]))
    ids = np.concatenate(shards) if shards else np.zeros(0, dtype=np.uint16)
    assert str(ids.dtype) == manifest["dtype"]
    cuts = np.flatnonzero(ids == entry["separator_id"])
    assert len(ids) == 0 or cuts[-1] == len(ids) - 1, "every document ends with the separator"
    texts, start = [], 0
    for cut in cuts:
        texts.append(tokenizer.decode(ids[start:cut].tolist()))
        start = cut + 1
    return texts


def test_every_input_kind_is_read_and_the_shards_hold_each_document_once(tmp_path):
    (tmp_path / "in").mkdir()
    docs, inputs = every_kind(tmp_path / "in", per_kind=400)
    out = tmp_path / "out"
    result = _data("prepare", *map(str, inputs), "--output", str(out), "--shard-tokens", "20000",
                   "--heldout-fraction", "0.05", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    manifest = _prepared(out)
    assert [s["kind"] for s in manifest["sources"]] == ["txt", "jsonl", "jsonl", "jsonl", "parquet", "datasets"]
    train, heldout = _texts(out, "train"), _texts(out, "heldout")
    assert sorted(train + heldout) == sorted(docs), "every document exactly once, in one split"
    assert 0.02 < len(heldout) / len(docs) < 0.09, len(heldout)
    assert manifest["splits"]["train"]["documents"] == len(train) == report["splits"]["train"]["documents"]
    assert manifest["splits"]["train"]["shards"][0]["tokens"] == 20000
    assert report["splits"]["train"]["shards"] == len(manifest["splits"]["train"]["shards"]) > 1
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["kind"] == "byte"

    again = _data("prepare", *map(str, inputs), "--output", str(out), "--shard-tokens", "20000",
                  "--heldout-fraction", "0.05")
    assert again.returncode == 0 and "already prepared" in again.stdout, again.stdout + again.stderr
    inspected = _data("inspect", str(out), "--json")
    assert json.loads(inspected.stdout)["manifest_sha256"] == report["manifest_sha256"]


def test_a_trained_tokenizer_encodes_the_corpus_and_decodes_it_back(tmp_path):
    docs = documents(1500)
    write_parquet(tmp_path / "corpus.parquet", docs)
    out = tmp_path / "out"
    result = _data("prepare", str(tmp_path / "corpus.parquet"), "--output", str(out), "--train-tokenizer", "600",
                   "--heldout-fraction", "0.02", "--config", "tiny", "--json")
    assert result.returncode == 2 and "larger than the run config's model.vocab_size" in result.stderr, result.stderr
    assert not out.exists() or not (out / "manifest.json").exists()

    result = _data("prepare", str(tmp_path / "corpus.parquet"), "--output", str(out), "--train-tokenizer", "600",
                   "--heldout-fraction", "0.02", "--json")
    assert result.returncode == 0, result.stderr
    manifest = _prepared(out)
    tokenizer = manifest["tokenizer"]
    assert tokenizer["kind"] == "tokenizers" and tokenizer["trained"] and tokenizer["vocab_size"] == 600
    assert sorted(_texts(out, "train") + _texts(out, "heldout")) == sorted(docs)
    byte_tokens = sum(len(d.encode()) + 1 for d in docs)
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    assert tokens < 0.5 * byte_tokens, (tokens, byte_tokens)  # merges learnt on this grammar compress it


def test_a_killed_preparation_continues_to_the_same_bytes(tmp_path):
    docs = documents(30_000)
    for i in range(3):
        write_jsonl(tmp_path / f"part-{i}.jsonl.zst", docs[i::3])
    inputs = [str(tmp_path / f"part-{i}.jsonl.zst") for i in range(3)]
    args = ["--shard-tokens", "65536", "--heldout-fraction", "0.01", "--quiet"]

    whole = tmp_path / "whole"
    assert _data("prepare", *inputs, "--output", str(whole), *args).returncode == 0

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "data", "prepare", *inputs, "--output", str(out),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def shards_written() -> int:
            try:
                state = json.loads((out / "prepare-state.json").read_text())
            except (OSError, ValueError):
                return 0
            return sum(len(s["shards"]) for s in state.get("splits", {}).values())

        poll_until(lambda: shards_written() >= 3 or proc.poll() is not None, 120, "three shards written")
        assert proc.poll() is None, "the preparation ended before it could be killed; give it more to do"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (out / "manifest.json").exists()

    result = _data("prepare", *inputs, "--output", str(out), *args[:-1], "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["resumed_shards"] >= 3
    assert _prepared(out)["splits"] == _prepared(whole)["splits"], "the same shards, byte for byte"
    assert not (out / "prepare-state.json").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no temporary file left behind"


@pytest.mark.parametrize("case, fragment", [
    ("missing", "does not exist"),
    ("parquet-column", "has no column 'text' (columns: body, id)"),
    ("jsonl-field", "has no text field 'text'"),
    ("broken-zst", "cannot read input"),
    ("unknown-kind", "is of no kind prepare reads"),
    ("not-empty", "is not empty and holds no preparation"),
])
def test_bad_input_is_refused_in_one_sentence(tmp_path, case, fragment):
    out = tmp_path / "out"
    path = tmp_path / "input"
    if case == "parquet-column":
        path = tmp_path / "c.parquet"
        write_parquet(path, documents(10), column="body")
    elif case == "jsonl-field":
        path = tmp_path / "c.jsonl"
        write_jsonl(path, documents(10), field="content")
    elif case == "broken-zst":
        path = tmp_path / "c.jsonl.zst"
        path.write_bytes(b"this is not zstd at all")
    elif case == "unknown-kind":
        path = tmp_path / "c.csv"
        path.write_text("a,b\n")
    elif case == "not-empty":
        path = tmp_path / "c.jsonl"
        write_jsonl(path, documents(10))
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    result = _data("prepare", str(path), "--output", str(out))
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(errors) == 1 and errors[0].startswith("agora-node: error:") and fragment in errors[0], result.stderr
    assert "Traceback" not in result.stderr
