"""Surrogate stages [report 3.5.1]: presets that mirror the real runs' traffic on both axes, a
payload that is averaged but never stepped, a cheap loss that still falls, and slept delays."""

from __future__ import annotations

import math
import time

import pytest
import torch

from protocol.errors import ConfigError
from protocol.run_config import load_run_config
from roles.model.memory_plan import plan_memory, stage_parameter_count
from roles.model.stage import build_stage_model
from roles.model.surrogate import SurrogateStage
from roles.model.surrogate_sizes import surrogate_averaged_count, surrogate_payload_count
from roles.model.traffic_plan import averaged_values_per_round
from roles.worker.averaging.index_sets import SegmentIndexSets
from roles.worker.layout import FlatLayout
from roles.worker.steps.optimizer import StageOptimizer

MIRRORS = {"surrogate-1b": "1b", "surrogate-8b": "8b"}


def _worker_parts(run, stage):
    """Model, optimizer and layout exactly as WorkerRole builds them."""
    model = build_stage_model(run, stage)
    optimizer = StageOptimizer.for_stage(run, stage, model.trainable_parameters(), "cpu",
                                         payload=[t for _, t in model.averaged_payload()])
    layout = FlatLayout.of_stage(model)
    layout.check(optimizer.master_params)
    return model, optimizer, layout


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_surrogate_presets_keep_the_mirrored_shape(name):
    surrogate, real = load_run_config(name), load_run_config(MIRRORS[name])
    assert surrogate.model.kind == "surrogate" and real.model.kind == "transformer"
    assert surrogate.surrogate.mirrors == MIRRORS[name]
    assert surrogate.surrogate.mirror_segments == real.averaging.segments
    assert surrogate.averaging.segments == 1
    assert (surrogate.seq_len, surrogate.model.subspace_rank, surrogate.stages, surrogate.target_batch_size) == (
        real.seq_len, real.model.subspace_rank, real.stages, real.target_batch_size)


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_averaged_values_per_round_equal_the_mirrored_stage(name):
    surrogate, real = load_run_config(name), load_run_config(MIRRORS[name])
    for stage in range(real.num_stages):
        expected = math.ceil(stage_parameter_count(real, stage) / real.averaging.segments)
        assert averaged_values_per_round(real, stage) == expected
        assert averaged_values_per_round(surrogate, stage) == expected
        assert math.ceil(surrogate_averaged_count(surrogate, stage) / surrogate.averaging.segments) == expected


def test_the_worker_layout_averages_as_many_values_as_the_real_round():
    """Built as a worker builds it: the index set the averager fills has the real round's length."""
    run = load_run_config("surrogate-1b")
    for stage in range(run.num_stages):
        _, optimizer, layout = _worker_parts(run, stage)
        assert layout.numel == surrogate_averaged_count(run, stage)
        sets = SegmentIndexSets(layout, run.averaging.segments, seed=run.seed, stage=stage)
        assert sets.buffer_size == averaged_values_per_round(load_run_config("1b"), stage)
        assert len(sets.get(0)) == layout.numel  # one segment: every value, every round


def test_a_segment_override_keeps_the_round_size():
    run = load_run_config("surrogate-1b", {"averaging.segments": 3})
    real = load_run_config("1b")
    assert averaged_values_per_round(run, 1) == averaged_values_per_round(real, 1)
    assert surrogate_payload_count(run, 1) > 2 * surrogate_payload_count(load_run_config("surrogate-1b"), 1)


def test_boundary_tensors_have_the_mirrored_shape():
    run = load_run_config("surrogate-8b")
    body = SurrogateStage(run, 1)
    tokens = torch.randint(0, run.model.vocab_size, (1, run.seq_len))
    coords = torch.randn(1, run.seq_len, run.model.subspace_rank)
    with torch.no_grad():
        out = body(coords, tokens)
    assert out.dtype == torch.float32 and tuple(out.shape) == (1, 4096, 51)
    assert run.seq_len == load_run_config("8b").seq_len == 4096


def _small(**overrides):
    base = {"seq_len": 32, "target_batch_size": 4,
            "optimizer": {"lr": 1e-2, "warmup_steps": 0, "total_steps": 1000, "weight_decay": 0.0}}
    base.update(overrides)
    return load_run_config("surrogate-1b", base)


def test_payload_is_averaged_but_never_stepped_and_loss_falls():
    run = _small()
    parts = [_worker_parts(run, stage) for stage in range(run.num_stages)]
    payloads = [model.averaged_payload()[0][1].clone() for model, _, _ in parts]
    for (model, optimizer, layout), payload in zip(parts, payloads):
        assert optimizer.master_params[0] is model.averaged_payload()[0][1]  # the layout's first tensor
        assert torch.equal(layout.read(optimizer.master_params, 0, 16), payload[:16])  # state transfer sees it

    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        first = torch.randint(0, 50, (4, 1), generator=g)
        tokens = (first + 7 * torch.arange(run.seq_len)) % 50  # a bigram the stages can learn
        hidden = parts[0][0](None, tokens)
        middle = parts[1][0](hidden, tokens)
        loss = parts[3][0](parts[2][0](middle, tokens), tokens)
        loss.sum().backward()
        losses.append(float(loss.detach().mean()))
        for _, optimizer, _ in parts:
            optimizer.add_samples(4)
            optimizer.step()
    assert losses[-1] < 0.8 * losses[0], losses

    for (model, optimizer, _), payload in zip(parts, payloads):
        assert torch.equal(model.averaged_payload()[0][1], payload), "the payload was stepped"
        moments = optimizer.state_dict()["optimizer"]["state"]
        assert len(moments) == len(model.trainable_parameters())  # AdamW state for trainable tensors only
        assert optimizer.previous is None or len(optimizer.previous) == len(model.trainable_parameters())


def test_delays_are_slept_per_batch_and_per_sample():
    run = _small(surrogate={"mirrors": "1b", "mirror_segments": 20, "forward_s": 0.1, "forward_per_sample_s": 0.05,
                            "backward_s": 0.2, "backward_per_sample_s": 0.1})
    body = SurrogateStage(run, 1)
    tokens = torch.randint(0, 50, (4, run.seq_len))
    coords = torch.randn(4, run.seq_len, run.model.subspace_rank)
    assert body.delay_s(4, backward=False) == pytest.approx(0.3)
    assert body.delay_s(4, backward=True) == pytest.approx(0.6)

    wall, cpu = time.monotonic(), time.process_time()
    with torch.no_grad():
        body(coords, tokens)
    forward_wall, forward_cpu = time.monotonic() - wall, time.process_time() - cpu
    wall = time.monotonic()
    body(coords.requires_grad_(True), tokens).sum().backward()
    backward_wall = time.monotonic() - wall
    assert 0.3 <= forward_wall < 3.0
    assert 0.6 <= backward_wall < 4.0
    assert forward_cpu < 0.5 * forward_wall, "the delay must sleep, not spin"


@pytest.mark.parametrize("overrides, fragment", [
    ({"model.kind": "surrogate", "surrogate": None}, "surrogate: section is missing"),
    ({"model.kind": "transformer"}, "model.kind is transformer"),
    ({"surrogate.forward_s": -1}, "surrogate.forward_s"),
    ({"surrogate.mirror_segments": 0}, "surrogate.mirror_segments"),
    ({"surrogate.width": 0}, "surrogate.width"),
    ({"surrogate.colour": 1}, "not a known field"),
    ({"model.kind": "mlp"}, "model.kind"),
])
def test_invalid_surrogate_configs_fail_with_one_line(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_run_config("surrogate-1b", overrides)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_memory_plan_of_an_8b_body_surrogate_is_modest():
    run = load_run_config("surrogate-8b")
    plan = plan_memory(run, 1, "cpu", 8)
    assert plan.payload_values == surrogate_payload_count(run, 1) > 40_000_000
    assert plan.host_bytes + plan.device_bytes < 1.5 * 2**30, plan.describe()
    assert "averaged-only" in plan.describe()
