"""The analytic memory plan: exact parameter accounting, sane totals, instant for 8B."""

from __future__ import annotations

import time

import pytest
import torch

from protocol.run_config import load_run_config
from roles.model.memory_plan import MemoryPlan, plan_memory, stage_parameter_count
from roles.model.stage import StageModel

GIB = 1 << 30


def _saved_bytes(stage: StageModel, run) -> int:
    """Bytes autograd keeps for one sample's forward through the stage (its loss at the tail),
    parameters and buffers not counted, each storage once."""
    own = {t.data_ptr() for t in (*stage.parameters(), *stage.buffers())}
    seen: set[tuple[int, int]] = set()
    total = 0

    def pack(tensor):
        nonlocal total
        key = (tensor.data_ptr(), tensor.numel())
        if tensor.data_ptr() not in own and key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
        return tensor

    tokens = torch.randint(0, run.model.vocab_size, (1, run.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        coords = None if stage.kind == "head" else torch.randn(1, run.seq_len, run.model.subspace_rank,
                                                                 requires_grad=True)
        hidden = stage.run_blocks(stage.enter(coords, tokens))
        if stage.kind == "tail":
            stage.loss_from_hidden(hidden, tokens)
        else:
            stage.leave(hidden, tokens)
    return total


@pytest.mark.parametrize("model", [{"construction": "stage-anchors"}, {"construction": "stage-anchors", "anchor_rank": 8},
                                   {"construction": "fixed-embedding"}])
def test_the_activation_estimate_covers_what_autograd_keeps_in_either_construction(model):
    """The estimate (saved tensors plus the backward's transients) is at least what autograd
    saves, and not wildly more: anchors add their factored rows, nothing at full rank (the
    projection off U_k saves no copy of them, U_k being a buffer)."""
    run = load_run_config("tiny", {"model": model})
    for index in range(run.num_stages):
        saved = _saved_bytes(StageModel(run, index), run)
        planned = plan_memory(run, index, "cpu", max_batch=1).activation_bytes_per_sample
        assert saved <= planned <= 3 * saved, (index, saved, planned)


@pytest.mark.parametrize("overrides", [None, {"model": {"tail_full_rank": False}}])
def test_tiny_parameter_bytes_match_the_real_stages(overrides):
    run = load_run_config("tiny", overrides)
    for index in range(run.num_stages):
        stage = StageModel(run, index)
        real = sum(p.numel() * p.element_size() for p in stage.trainable_parameters())
        plan = plan_memory(run, index, "cpu", max_batch=4)
        assert plan.param_bytes == real
        assert plan.num_params == stage_parameter_count(run, index)
        pipelined = stage.kind != "tail"  # head and body keep the next step's gradients and the previous weights
        assert plan.grad_bytes == real * (2 if pipelined else 1)
        assert plan.previous_weights_bytes == (real if pipelined else 0)
        assert plan.optimizer_host_bytes == 3 * 4 * plan.num_params


def test_bfloat16_halves_device_weights_but_not_host_optimizer():
    fp32 = plan_memory(load_run_config("tiny"), 1, "cpu", 1)
    bf16 = plan_memory(load_run_config("tiny", {"dtype": "bfloat16"}), 1, "cpu", 1)
    assert bf16.param_bytes * 2 == fp32.param_bytes
    assert bf16.optimizer_host_bytes == fp32.optimizer_host_bytes


def test_eight_b_body_stage_plans_instantly():
    run = load_run_config("8b")
    started = time.perf_counter()
    plan = plan_memory(run, 3, "cuda:0", max_batch=2)
    assert time.perf_counter() - started < 1.0
    assert plan.kind == "body" and plan.device_bytes > 0
    # five blocks of ~221M values each, in bfloat16
    assert 2.0 * GIB < plan.param_bytes < 2.3 * GIB
    weights = plan.param_bytes + plan.grad_bytes + plan.previous_weights_bytes
    assert plan.device_bytes > weights + 2 * plan.activation_bytes_per_sample
    assert plan.host_bytes > plan.optimizer_host_bytes > 12 * GIB
    assert "stage 3" in plan.describe() and "GiB" in plan.describe()


def test_tail_pays_for_the_vocabulary_logits():
    run = load_run_config("8b")
    body = plan_memory(run, 5, "cuda:0", 1)
    tail = plan_memory(run, 6, "cuda:0", 1)
    logits = run.seq_len * run.model.vocab_size * 4
    assert tail.activation_bytes_per_sample - body.activation_bytes_per_sample > 2 * logits


def test_materialized_scores_cost_more_off_cuda():
    run = load_run_config("1b")
    assert (
        plan_memory(run, 1, "cpu", 1).activation_bytes_per_sample
        > plan_memory(run, 1, "cuda", 1).activation_bytes_per_sample
    )


def test_max_batch_that_fits_is_consistent_with_device_bytes():
    run = load_run_config("8b")
    plan = plan_memory(run, 3, "cuda:0", max_batch=1)
    free = 80 * GIB
    batch = plan.max_batch_that_fits(free)
    assert batch >= 1
    assert plan_memory(run, 3, "cuda:0", batch).device_bytes <= free
    assert plan_memory(run, 3, "cuda:0", batch + 1).device_bytes > free
    assert plan.max_batch_that_fits(plan.param_bytes) == 0
    on_host = plan_memory(run, 3, "cpu", max_batch=1)
    host_free = on_host.host_bytes + on_host.device_bytes
    assert on_host.max_batch_that_fits(None, host_free) == 1
    with pytest.raises(ValueError):
        on_host.max_batch_that_fits(None)


def test_fits_checks_device_and_host():
    plan: MemoryPlan = plan_memory(load_run_config("1b"), 1, "cuda:0", 2)
    assert plan.fits(plan.device_bytes, plan.host_bytes)
    assert not plan.fits(plan.device_bytes - 1, plan.host_bytes)
    assert not plan.fits(plan.device_bytes, plan.host_bytes - 1)
    assert plan.fits(None, plan.device_bytes + plan.host_bytes)
    assert not plan.fits(None, plan.host_bytes)


def test_rejects_an_empty_batch():
    with pytest.raises(ValueError):
        plan_memory(load_run_config("tiny"), 0, "cpu", 0)


def test_a_gpu_worker_sizes_its_batch_to_half_the_memory_its_weights_leave_free():
    run = load_run_config("1b")
    plan = plan_memory(run, 1, "cuda:0", max_batch=1)
    free = 80 * GIB
    batch = plan.auto_max_batch(free, cap=4096)
    # The plan is linear in the batch: extrapolated to batch 0 it is what the weights need.
    weights = 2 * plan_memory(run, 1, "cuda:0", 1).device_bytes - plan_memory(run, 1, "cuda:0", 2).device_bytes
    half = weights + (free - weights) // 2
    assert plan_memory(run, 1, "cuda:0", batch).device_bytes <= half < plan_memory(run, 1, "cuda:0", batch + 1).device_bytes
    assert 1 < batch < plan.max_batch_that_fits(free), "half the card, not all of it"
    assert plan.auto_max_batch(free, cap=16) == min(16, batch)
    assert plan.auto_max_batch(plan.param_bytes // 2, cap=16) == 0, "not even the weights fit"
