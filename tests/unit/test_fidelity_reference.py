"""The fidelity benchmark's one-process reference: it must step exactly as a swarm's stage
optimizers would, and the unconstrained model it compares against must train."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from protocol.run_config import RunConfig, load_run_config
from roles.model.plain import PlainModel
from roles.model.stage import FullModel, StageModel
from roles.worker.layout import FlatLayout
from roles.worker.steps.optimizer import StageOptimizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from _fidelity_reference import (  # noqa: E402
    OneProcessTrainer,
    SampleBank,
    StaleReplay,
    StepRecord,
    load_stage_weights,
    loss_figures,
    stream_index,
)


@pytest.fixture(scope="module")
def run() -> RunConfig:
    return load_run_config("tiny", {"target_batch_size": 4, "optimizer": {"warmup_steps": 1, "total_steps": 4}})


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_reference_steps_like_stage_optimizers_fed_the_same_samples(run):
    bank = SampleBank(run)
    steps = [[5, 0, 3], [1, 2, 7, 4, 6]]  # a short and a long step, out of stream order

    trainer = OneProcessTrainer.for_stages(run)
    trainer.train(steps, bank)

    stages = [StageModel(run, i) for i in range(run.num_stages)]
    full = FullModel.from_stages(stages)
    optimizers = [StageOptimizer.for_stage(run, i, s.trainable_parameters(), "cpu", keep_previous=False)
                  for i, s in enumerate(stages)]
    for indices in steps:
        # As workers do: each sample's own backward, summed gradients, one step per stage.
        for index in indices:
            full(bank.tokens([index])).sum().backward()
        for optimizer in optimizers:
            optimizer.add_samples(len(indices))
            optimizer.step()

    assert [r.samples for r in trainer.history] == [3, 5]
    for ours, theirs in zip(trainer.model.stages, stages):
        for a, b in zip(ours.trainable_parameters(), theirs.trainable_parameters()):
            # Summation order differs (per-sample vs batched backward); a wrong step would be off by ~lr.
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
    moved = [not torch.equal(a, b) for a, b in zip(trainer.model.stages[0].trainable_parameters(),
                                                  StageModel(run, 0).trainable_parameters())]
    assert all(moved)


def test_stage_weights_round_trip_through_layout_names(run):
    trained = OneProcessTrainer.for_stages(run)
    trained.train([[0, 1]], SampleBank(run))
    source = trained.model.stages[1]
    fresh = StageModel(run, 1)
    names = FlatLayout.of_module(source).names
    load_stage_weights(fresh, dict(zip(names, (p.detach() for p in source.trainable_parameters()))))
    for a, b in zip(fresh.trainable_parameters(), source.trainable_parameters()):
        assert torch.equal(a, b)


def test_sample_bank_matches_a_trainer_shard(run):
    from roles.trainer.data import make_sample_stream

    shard = iter(make_sample_stream("synthetic", None, run.seq_len, 1, 2, run.seed, epochs=None))
    samples = [next(shard) for _ in range(3)]
    bank = SampleBank(run)
    for sample in samples:
        assert torch.equal(bank.tokens([stream_index(sample.sample_id)])[0], sample.tokens)
    assert stream_index("ab12cd34-s1-7") == 7


def test_loss_figures_windows():
    steps = [StepRecord(10, float(i)) for i in range(20)]
    figures = loss_figures(steps)
    assert figures["final_train_loss"] == pytest.approx(18.5)
    assert figures["train_loss_at_fraction"]["25%"] == pytest.approx(3.5)  # steps 3 and 4
    assert figures["train_loss_at_fraction"]["100%"] == pytest.approx(18.5)
    assert figures["samples"] == 200


def test_plain_model_trains_from_uniform_loss(run):
    model = PlainModel(run)
    tokens = SampleBank(run).tokens(range(4))
    losses = model(tokens)
    assert losses.shape == (4,)
    assert float(losses.detach().mean()) == pytest.approx(math.log(run.model.vocab_size), abs=0.1)
    groups = model.stage_parameters(run)
    assert len(groups) == run.num_stages
    assert sum(len(g) for g in groups) == len(list(model.parameters()))
    assert {id(p) for g in groups for p in g} == {id(p) for p in model.parameters()}

    trainer = OneProcessTrainer(model, groups, run)
    first = trainer.step(tokens)
    for _ in range(3):
        last = trainer.step(tokens)
    assert last < first
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_plain_model_init_is_seeded(run):
    a, b = PlainModel(run), PlainModel(run)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    other = PlainModel(run.model_copy(update={"seed": run.seed + 1}))
    assert not torch.equal(a.llama.model.embed_tokens.weight, other.llama.model.embed_tokens.weight)


def test_replay_at_current_versions_is_the_plain_reference(run):
    bank = SampleBank(run)
    steps = [[0, 1, 2], [3, 4]]
    plain = OneProcessTrainer.for_stages(run)
    plain.train(steps, bank)
    replayed = OneProcessTrainer.for_stages(run)
    replay = StaleReplay(replayed)
    for number, indices in enumerate(steps):
        replay.step(number, bank.tokens(indices), [(number,) * run.num_stages] * len(indices))
    for a, b in zip(plain.model.parameters(), replayed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [r.loss for r in plain.history] == pytest.approx([r.loss for r in replayed.history], abs=1e-5)


def test_a_sample_retracted_at_some_stages_leaves_those_stages_as_if_it_never_came(run):
    bank = SampleBank(run)
    full, alone, retracted = (OneProcessTrainer.for_stages(run) for _ in range(3))
    full.train([[0, 1]], bank)
    alone.train([[0]], bank)
    retracted.train([[0, 1]], bank, retracted={1: {0, 2}})  # sample 1 taken back at stages 0 and 2
    for stage, (f, a, r) in enumerate(zip(full.groups, alone.groups, retracted.groups)):
        expected = a if stage in (0, 2) else f
        for want, got in zip(expected, r):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_bench_reads_retractions_beside_the_samples(tmp_path):
    import json

    import bench_fidelity

    log = tmp_path / "samples.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in [
        {"sample_id": "s0-5", "step": 0, "loss": 2.0, "versions": [0, 0, 0], "skipped": []},
        {"sample_id": "t1-s0-5", "retracted_at": 1}, {"sample_id": "t1-s0-5", "retracted_at": 0},
    ]) + "\n")
    steps, bad = bench_fidelity.read_sample_logs([str(log)])
    assert bad == 0 and [index for index, _, _ in steps[0]] == [5]
    assert bench_fidelity.read_retractions([str(log)]) == {5: {0, 1}}


def test_replay_takes_stale_gradients_at_the_logged_versions(run):
    """Step 1 holds a sample the head and body forwarded on version 0: its gradient there must be
    taken at the initial weights, the tail's at the current ones."""
    bank = SampleBank(run)
    replayed = OneProcessTrainer.for_stages(run)
    replay = StaleReplay(replayed)
    replay.step(0, bank.tokens([0, 1]), [(0, 0, 0)] * 2)
    replay.step(1, bank.tokens([2, 3]), [(1, 1, 1), (0, 0, 1)])

    manual = OneProcessTrainer.for_stages(run)
    initial = [[p.detach().clone() for p in s.trainable_parameters()] for s in manual.model.stages]
    manual.step(bank.tokens([0, 1]))
    manual.model(bank.tokens([2])).sum().backward()
    # The stale sample: head and body at the initial weights, tail at the current ones.
    old = [StageModel(run, i) for i in range(run.num_stages)]
    with torch.no_grad():
        for stage, weights in zip(old[:2], initial[:2]):
            for p, w in zip(stage.trainable_parameters(), weights):
                p.copy_(w)
        for p, q in zip(old[2].trainable_parameters(), manual.model.stages[2].trainable_parameters()):
            p.copy_(q)
    FullModel.from_stages(old)(bank.tokens([3])).sum().backward()
    for stage, stale in zip(manual.model.stages, old):
        for p, q in zip(stage.trainable_parameters(), stale.trainable_parameters()):
            p.grad.add_(q.grad)
    for optimizer in manual.optimizers:
        optimizer.add_samples(2)
        optimizer.step()
    for a, b in zip(manual.model.parameters(), replayed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
    fresh = OneProcessTrainer.for_stages(run)
    fresh.train([[0, 1], [2, 3]], bank)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(fresh.model.parameters(),
                                                                  replayed.model.parameters()))


@pytest.mark.parametrize("replicas", [1, 2])
def test_bench_reads_a_swarm_that_trained_exactly_like_the_reference(monkeypatch, tmp_path, replicas):
    """A fake swarm (the reference itself, with its sample logs and final checkpoints) must come
    out with zero gaps: log parsing, step grouping, checkpoint loading and the replay agree."""
    import json

    import bench_fidelity
    from roles.worker.state.stage_checkpoint import checkpoint_path, write_checkpoint

    def fake_swarm(run, config_path, workdir, setting, total, replicas):
        bank = SampleBank(run)
        trainer = OneProcessTrainer.for_stages(run)
        steps = bank.sequential_steps(total, run.target_batch_size)
        logs = [str(tmp_path / f"samples-{k}.jsonl") for k in range(2)]
        with open(logs[0], "w") as a, open(logs[1], "w") as b:
            for number, indices in enumerate(steps):
                trainer.step(bank.tokens(indices))
                for index in indices:
                    (a if index % 2 == 0 else b).write(json.dumps({
                        "sample_id": f"s{index % 2}-{index}", "step": number, "loss": trainer.history[-1].loss,
                        "versions": [number] * run.num_stages}) + "\n")
        directories = [tmp_path / f"r{r}" for r in range(replicas)]
        for directory in directories:  # replicas that stayed equal, as the gradient exchange keeps them
            for stage in trainer.model.stages:
                names = FlatLayout.of_module(stage).names
                write_checkpoint(checkpoint_path(directory, run.run_id, stage.stage_index),
                                 {n: p.detach().clone() for n, p in zip(names, stage.trainable_parameters())},
                                 {"step": str(len(steps))})
        return {"sample_logs": logs, "checkpoint_dirs": [str(d) for d in directories], "errors": [],
                "summaries": {}, "stages": {}, "replica_of": {}}

    monkeypatch.setattr(bench_fidelity, "run_swarm", fake_swarm)
    monkeypatch.setitem(bench_fidelity.SETTINGS, "demo", bench_fidelity.Setting(
        target_batch_size=4, steps=3, quick_steps=3, worker_max_batch=4, held_out_gap_max=0.03))
    args = bench_fidelity.parse_args(["--quick", "--setting", "demo", "--noise-runs", "1",
                                      "--workers-per-stage", str(replicas)])
    result = bench_fidelity.bench_setting("demo", args)
    assert result["errors"] == []
    assert result["gaps"]["held_out"] == pytest.approx(0.0, abs=2e-4)
    assert result["gaps"]["held_out_vs_replay"] == pytest.approx(0.0, abs=2e-4)
    assert result["gaps"]["order_alone_held_out"] == pytest.approx(0.0, abs=2e-4)
    assert result["swarm"]["staleness_from_log"]["0"]["stale_share"] == 0
    assert result["swarm"]["samples_per_step_from_log"]["steps_not_at_target"] == 0
    noise = result["reference"]["order_noise"]
    assert len(noise["held_out_losses"]) == 2 and noise["relative_std"] > 0
    assert len(result["swarm"]["held_out_loss_per_replica"]) == replicas
    assert result["gaps"]["held_out_worst_replica"] == pytest.approx(0.0, abs=2e-4)
    if replicas > 1:
        assert result["swarm"]["replicas"]["0"]["relative_distance"] == pytest.approx(0.0, abs=1e-6)


def test_replay_takes_a_retracted_sample_out_at_the_versions_it_was_taken_at(run):
    """bench_trust's own-order reference: a sample the swarm retracted at some stages leaves them
    as if it never came, also when its forward saw an older version there (its gradient was a
    step old, and so is what the retraction took back)."""
    bank = SampleBank(run)
    with_it, without = OneProcessTrainer.for_stages(run), OneProcessTrainer.for_stages(run)
    replays = StaleReplay(with_it), StaleReplay(without)
    for replay in replays:
        replay.step(0, bank.tokens([0, 1]), [(0, 0, 0)] * 2)
    replays[0].step(1, bank.tokens([2, 3]), [(1, 1, 1), (0, 0, 1)], retracted={1: {0, 1, 2}})
    replays[1].step(1, bank.tokens([2]), [(1, 1, 1)])
    for a, b in zip(with_it.model.parameters(), without.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    fresh = OneProcessTrainer.for_stages(run)
    StaleReplay(fresh).step(0, bank.tokens([0, 1]), [(0, 0, 0)] * 2, retracted={1: {1}})
    plain = OneProcessTrainer.for_stages(run)
    plain.train([[0, 1]], bank, retracted={1: {1}})
    for a, b in zip(fresh.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
