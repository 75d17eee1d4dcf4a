"""Trainers reading a prepared corpus from a real S3-compatible server: two trainers split the
training shards between them, never read a held-out sample, and a trainer killed mid-run
continues its walk through the data without a sample twice or one skipped."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from corpus.prepare import PrepareOptions, prepare
from corpus.shards import PreparedCorpus, PreparedSampleStream
from tests.support.corpus import documents, write_jsonl
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration


def _log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut by the kill
            pass
    return rows


def _walk(corpus_dir: Path, run, index: int, of: int, count: int) -> list[str]:
    stream = PreparedSampleStream(PreparedCorpus(str(corpus_dir)), run.seq_len, shard_index=index, num_shards=of,
                                  seed=run.seed, cache_dir=corpus_dir / "unused")
    return [s.sample_id for _, s in zip(range(count), stream)]


@pytest.mark.timeout(420)
def test_two_trainers_share_the_shards_from_s3_and_a_killed_one_resumes_its_position(
        make_swarm, run_config_path, tmp_path, s3):
    from protocol.run_config import load_run_config

    write_jsonl(tmp_path / "docs.jsonl", documents(2500))
    corpus = tmp_path / "corpus"
    prepare(PrepareOptions(inputs=[str(tmp_path / "docs.jsonl")], output=corpus, shard_tokens=8192,
                           heldout_fraction=0.05, progress=False))
    bucket = s3.bucket()
    s3.filesystem().put(str(corpus) + "/", f"{bucket}/corpus/", recursive=True)
    url = f"s3://{bucket}/corpus"
    sha = PreparedCorpus(str(corpus)).sha256

    config = run_config_path(data={"manifest_sha256": sha, "location": url})
    run = load_run_config(config)
    swarm = make_swarm(config)
    swarm.start("worker", stage=0, args=["--max-batch", "16"])  # the others join through it
    for stage in range(1, run.num_stages):
        swarm.start("worker", stage=stage, wait_ready=False, args=["--max-batch", "16"])
    for node in swarm.nodes:
        swarm.wait_ready(node)

    # a trainer with other data is refused before it joins, in one sentence
    other = tmp_path / "other"
    prepare(PrepareOptions(inputs=[str(tmp_path / "docs.jsonl")], output=other, shard_tokens=4096, progress=False))
    refused = swarm.start("trainer", args=["--data", str(other)], wait_ready=False, name="refused")
    assert swarm.wait(refused, 60) == 2
    assert "is another" in refused.log_tail(), refused.log_tail()

    def trainer(index: int, samples: int, name: str):
        return swarm.start("trainer", name=name, env={**s3.env, "AGORA_SAMPLE_LOG": str(tmp_path / f"{name}.jsonl")},
                           args=["--num-shards", "2", "--shard-index", str(index), "--lanes", "4",
                                 "--data-dir", str(tmp_path / f"data{index}"), "--max-samples", str(samples)])

    steady = trainer(1, 120, "t1")
    killed = trainer(0, 400, "t0a")
    poll_until(lambda: len(_log(tmp_path / "t0a.jsonl")) >= 50, 180, "50 samples on trainer 0")
    os.kill(killed.pid, signal.SIGKILL)
    killed.proc.wait(10)
    first = [row["sample_id"] for row in _log(tmp_path / "t0a.jsonl")]
    position = json.loads(next((tmp_path / "data0").rglob("position-0-of-2.json")).read_text())

    resumed = trainer(0, 60, "t0b")
    assert swarm.wait(resumed, 240) == 0, resumed.log_tail()
    assert swarm.wait(steady, 240) == 0, steady.log_tail()
    summary_b, summary_1 = resumed.summary(), steady.summary()

    # trainer 1 read its own walk, from S3
    ids_1 = [row["sample_id"] for row in _log(tmp_path / "t1.jsonl")]
    assert summary_1["samples_completed"] + summary_1["samples_dropped"] == 120, summary_1
    assert len(set(ids_1)) == len(ids_1) and set(ids_1) <= set(_walk(corpus, run, 1, 2, 120))
    assert summary_1["data"]["location"] == url and summary_1["data"]["fetched_bytes"] > 0, summary_1["data"]

    # trainer 0: the restart continues where the position stood; nothing twice, nothing skipped
    second = [row["sample_id"] for row in _log(tmp_path / "t0b.jsonl")]
    assert summary_b["data"]["resumed_at"] == position["next"] > 0, (summary_b["data"], position)
    both = first + second
    assert len(set(both)) == len(both), "a sample trained twice across the restart"
    final = json.loads(next((tmp_path / "data0").rglob("position-0-of-2.json")).read_text())
    assert final["ended_above"] == [], "every sample the restarted trainer took has ended"
    prefix = set(_walk(corpus, run, 0, 2, final["next"]))
    assert set(both) <= prefix, "a sample from beyond the position"
    # what ended without a log line: samples dropped (counted in the summaries; the killed run's
    # summary went with it, so a few are allowed for it)
    assert len(prefix - set(both)) <= summary_b["samples_dropped"] + 4, (len(prefix), len(both))
    assert not set(ids_1) & set(both), "the two trainers' shares overlap"
    assert all(i.startswith("train-") for i in ids_1 + both), "a held-out sample was trained on"
