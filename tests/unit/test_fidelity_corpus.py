"""`bench_fidelity.py --data`: the one-process references must get exactly the tokens a swarm's
trainers read from a prepared corpus, by the sample ids they log; and the corpus the tests and the
quick run use is made from text already on the machine, the same bytes every time."""

from __future__ import annotations

import email.message
import itertools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from corpus.prepare import PrepareOptions, prepare
from corpus.shards import PreparedCorpus
from protocol.run_config import load_run_config
from roles.trainer.data import make_sample_stream, trainer_data

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from _fidelity_corpus import PreparedSampleBank, prepared_heldout_tokens  # noqa: E402
from make_text_corpus import make_text_corpus, package_license  # noqa: E402


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """About 0.5 MB of installed packages' descriptions, a 512-token BPE, shards of 4,096 tokens."""
    root = tmp_path_factory.mktemp("text")
    made = make_text_corpus(root / "text", 0.5, doc_root=root / "no-docs")
    assert made["bytes"] >= 400_000, "too little package documentation installed for the test corpus"
    out = root / "prepared"
    prepare(PrepareOptions(inputs=[made["path"]], output=out, train_tokenizer=512, shard_tokens=4096,
                           heldout_fraction=0.2, progress=False))
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_text_corpus_is_deterministic_and_keeps_its_sources(tmp_path):
    docs = tmp_path / "doc" / "somepkg"
    docs.mkdir(parents=True)
    (docs / "copyright").write_text("License: MIT\n")
    (docs / "changelog").write_text("somepkg (1.1)\n\n  * fixed a thing\n\nsomepkg (1.0)\n\n  * first\n")
    a = make_text_corpus(tmp_path / "a", 0.05, doc_root=tmp_path / "doc")
    b = make_text_corpus(tmp_path / "b", 0.05, doc_root=tmp_path / "doc")
    assert Path(a["path"]).read_bytes() == Path(b["path"]).read_bytes()
    lines = [json.loads(line) for line in Path(a["path"]).read_text().splitlines()]
    assert all(line["text"].strip() and line["license"] for line in lines)
    # More than all installed descriptions: the changelog follows them.
    c = make_text_corpus(tmp_path / "c", 1000, doc_root=tmp_path / "doc")
    assert c["short_of_target"] and c["by_source"]["debian"]["documents"] == 1
    sources = [json.loads(line)["source"] for line in Path(c["path"]).read_text().splitlines()]
    assert "debian:somepkg/changelog" in sources
    assert sources != sorted(sources), "documents are mixed, not written source by source"


def test_package_license_keeps_open_licenses_only():
    def metadata(**fields) -> email.message.Message:
        message = email.message.Message()
        for key, value in fields.items():
            for item in value if isinstance(value, list) else [value]:
                message[key.replace("_", "-")] = item
        return message

    assert package_license(metadata(License_Expression="Apache-2.0")) == "Apache-2.0"
    assert package_license(metadata(Classifier=["License :: OSI Approved :: BSD License"])) == "BSD License"
    assert package_license(metadata(License="NVIDIA Proprietary Software")) is None
    assert package_license(metadata(Name="x")) is None


def test_prepared_bank_gives_what_each_trainer_reads_by_its_sample_ids(prepared, tmp_path):
    run = load_run_config("tiny", {"model": {"vocab_size": 512}, "data": {"location": str(prepared)}})
    corpus = PreparedCorpus(str(prepared))
    bank = PreparedSampleBank(run, corpus, 2, tmp_path / "bank")
    for shard in range(2):
        # The trainer's own path to its samples: its --data default, resolved by the run config.
        stream = make_sample_stream(trainer_data("synthetic", run), None, run.seq_len, shard, 2, run.seed,
                                    epochs=None, data_dir=str(tmp_path / f"trainer-{shard}"))
        per_epoch = stream.samples_per_epoch
        # The first samples, and a few of the second epoch (the same tokens under another id).
        wanted = [*range(20), per_epoch, per_epoch + 1]
        samples = list(itertools.islice(iter(stream), per_epoch + 2))
        stream.close()
        for k in wanted:
            sample = samples[k]
            number = bank.index(sample.sample_id)
            assert number == sample.ordinal * 2 + shard
            assert torch.equal(bank.tokens([number])[0], sample.tokens)
        assert samples[per_epoch].sample_id.endswith("-e1")
    assert bank.sequential_steps(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError):
        bank.index("s0-17")  # a synthetic stream's id names no shard of the corpus
    held_out = prepared_heldout_tokens(corpus, run.seq_len, 16, tmp_path / "bank")
    assert held_out.shape == (16, run.seq_len) and int(held_out.max()) < 512
    bank.close()


def test_bench_with_data_reads_a_swarm_that_trained_like_the_reference(monkeypatch, tmp_path, prepared):
    """A fake swarm whose two trainers read the corpus as real ones do (round-robin, logged by
    their own sample ids) and that trained exactly like the reference must come out with zero
    gaps; the run config, JSON config and parameter counts follow the corpus and --anchor-rank."""
    import bench_fidelity
    from _fidelity_reference import OneProcessTrainer
    from roles.worker.state.stage_checkpoint import checkpoint_path, write_checkpoint
    from roles.worker.layout import FlatLayout

    seen: dict = {}

    def fake_swarm(run, config_path, workdir, setting, total, replicas, node_args):
        seen["run"], seen["trainer_args"], seen["worker_args"] = run, node_args("trainer-0"), node_args("worker-s0-r0")
        streams = [iter(make_sample_stream(trainer_data("synthetic", run), None, run.seq_len, k, 2, run.seed,
                                           epochs=None, data_dir=str(tmp_path / f"t{k}"))) for k in range(2)]
        samples = [next(streams[n % 2]) for n in range(total)]  # the trainers' walks, round-robin
        trainer = OneProcessTrainer.for_stages(run)
        logs = [str(tmp_path / f"samples-{k}.jsonl") for k in range(2)]
        with open(logs[0], "w") as a, open(logs[1], "w") as b:
            for number in range(0, total, run.target_batch_size):
                step = samples[number:number + run.target_batch_size]
                trainer.step(torch.stack([s.tokens for s in step]))
                for n, sample in enumerate(step, start=number):
                    (a if n % 2 == 0 else b).write(json.dumps({
                        "sample_id": sample.sample_id, "step": number // run.target_batch_size,
                        "loss": trainer.history[-1].loss, "versions": [number // run.target_batch_size] * 3}) + "\n")
        directory = tmp_path / "r0"
        for stage in trainer.model.stages:
            names = FlatLayout.of_module(stage).names
            write_checkpoint(checkpoint_path(directory, run.run_id, stage.stage_index),
                             {n: p.detach().clone() for n, p in zip(names, stage.trainable_parameters())},
                             {"step": str(len(trainer.history))})
        return {"sample_logs": logs, "checkpoint_dirs": [str(directory)], "errors": [], "summaries": {},
                "stages": {}, "replica_of": {}}

    monkeypatch.setattr(bench_fidelity, "run_swarm", fake_swarm)
    monkeypatch.setitem(bench_fidelity.SETTINGS, "demo", bench_fidelity.Setting(
        target_batch_size=4, steps=3, quick_steps=3, worker_max_batch=4, held_out_gap_max=0.03))
    args = bench_fidelity.parse_args(["--quick", "--setting", "demo", "--data", str(prepared),
                                      "--anchor-rank", "8"])
    result = bench_fidelity.bench_setting("demo", args)
    assert result["errors"] == []
    run = seen["run"]
    assert run.model.vocab_size == 512 and run.model.anchor_rank == 8
    assert run.data.location == str(prepared.resolve()) and run.data.manifest_sha256
    assert seen["trainer_args"][0] == "--data-dir" and seen["worker_args"] == []
    assert result["swarm"]["samples_logged"] == 12 and result["swarm"]["unreadable_log_lines"] == 0
    assert result["gaps"]["held_out"] == pytest.approx(0.0, abs=2e-4)
    assert result["gaps"]["held_out_vs_replay"] == pytest.approx(0.0, abs=2e-4)
    assert result["gaps"]["order_alone_held_out"] == pytest.approx(0.0, abs=2e-4)
    data = result["config"]["data"]
    assert data["kind"] == "prepared" and data["vocab_size"] == 512 and data["train_tokens"] > 0
    plain = result["unconstrained"]
    assert plain["trained_parameters_ours"] == result["config"]["trained_parameters"]
    assert 0 < plain["trained_parameters"] and plain["anchor_rank_nearest_in_parameters"] >= 1
    assert 0 < result["swarm"]["train_split_epochs"] < 1


def test_the_in_run_curve_is_reported_with_its_error_beside_training_and_its_cost():
    import bench_fidelity

    points = [{"step": 0, "loss": 8.0, "stderr": 0.01, "samples": 4, "dropped": 0, "seconds": 1.0},
              {"step": 2, "loss": 6.0, "stderr": 0.09, "samples": 3, "dropped": 1, "seconds": 2.0}]
    summaries = {"trainer-1": {"eval": []}, "trainer-0": {"eval": points}, "worker-s0-r0": None}
    swarm_steps = {0: [(0, 7.0, None), (1, 7.0, None)], 1: [(2, 6.5, None), (3, 6.5, None)]}
    curve = bench_fidelity.evaluation_curve(summaries, swarm_steps, train_wall_s=10.0)
    assert [c["step"] for c in curve["curve"]] == [0, 2]
    assert curve["curve"][0]["train_loss_before"] is None and curve["curve"][1]["train_loss_before"] == 6.75
    assert curve["curve"][1]["relative_stderr"] == 0.015 and curve["relative_stderr_max_after_step_0"] == 0.015
    # 8 forwards against 4 training samples counted as three forwards each
    assert curve["forward_samples"] == 8 and curve["compute_share"] == round(8 / (8 + 12), 4)
    assert curve["seconds"] == 3.0 and curve["seconds_share_of_training"] == 0.3
    assert bench_fidelity.evaluation_curve({"trainer-0": {"eval": []}}, swarm_steps, 10.0) is None


def test_data_text_makes_and_prepares_a_corpus_once(tmp_path, monkeypatch):
    import bench_fidelity

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = bench_fidelity.parse_args(["--quick", "--data", "text:0.3"]).data
    manifest = Path(first) / "manifest.json"
    assert json.loads(manifest.read_text())["tokenizer"]["vocab_size"] == bench_fidelity.TEXT_DATA_VOCAB
    made = manifest.stat().st_mtime_ns
    assert bench_fidelity.parse_args(["--data", "text:0.3"]).data == first
    assert manifest.stat().st_mtime_ns == made, "a prepared corpus is reused, not prepared again"
    with pytest.raises(SystemExit):
        bench_fidelity.parse_args(["--data", str(tmp_path / "nothing-here")])
