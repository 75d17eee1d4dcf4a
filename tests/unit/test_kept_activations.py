"""Kept forward activations [issue 23, part 3]: a body or head stage that keeps its forward batch's
graph computes the same input gradients and parameter gradients as one that recomputes, waits for
the whole forward batch (an abandoned sample is a zero row), falls back to recompute when a
backward waits too long or the budget is spent, and hands parked backwards back when it stops."""

from __future__ import annotations

import contextlib

import pytest
import torch

from protocol.messages import BackwardRequest, ForwardRequest
from roles.worker.serving.queues import TaskKind
from tests.support.polling import poll_until
from tests.unit.test_step_boundaries import Replies, coords, make_run, make_runtime, tokens

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30


def forward(i: int, run, stage: int) -> ForwardRequest:
    return ForwardRequest(stage=stage, sample_id=f"s{i}", tokens=tokens(i, run),
                          coords=None if stage == 0 else coords(i, run))


def backward(i: int, run, stage: int, step: int = 0) -> BackwardRequest:
    return BackwardRequest(stage=stage, sample_id=f"s{i}", tokens=tokens(i, run),
                           coords=None if stage == 0 else coords(i, run), grad_output=coords(2000 + i, run),
                           step=step)


def run_forwards(runtime, run, stage: int, ids: list[int]) -> list[torch.Tensor]:
    """Forwards queued before the compute thread starts, so they make one batch."""
    replies = Replies()
    for i in ids:
        runtime.submit(TaskKind.FORWARD, forward(i, run, stage), replies.callback(f"s{i}"))
    runtime.start()
    return replies.wait([f"s{i}" for i in ids])


def run_backwards(runtime, run, stage: int, ids: list[int]) -> list:
    replies = Replies()
    for i in ids:
        runtime.submit(TaskKind.BACKWARD, backward(i, run, stage), replies.callback(f"s{i}"))
    return replies.wait([f"s{i}" for i in ids])


@contextlib.contextmanager
def runtimes(run, stage: int, *budgets: int):
    """Body or head runtimes (not started) with these kept-activation budgets, stopped after."""
    made = [make_runtime(run, stage, start=False, kept_activations_bytes=b) for b in budgets]
    try:
        yield made
    finally:
        for runtime in made:
            runtime.stop(5)


def gradients(runtime) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in runtime.optimizer.params])


@pytest.mark.parametrize("stage", [0, 1])
def test_a_kept_forward_gives_the_gradients_a_recomputed_one_does(stage):
    run = make_run(16)
    with runtimes(run, stage, GIB, 0) as (kept, recomputing):
        out_kept = run_forwards(kept, run, stage, [0, 1, 2, 3])
        out_recomputed = run_forwards(recomputing, run, stage, [0, 1, 2, 3])
        for a, b in zip(out_kept, out_recomputed):
            torch.testing.assert_close(a, b)
        assert kept.counters["forward_kept"] == 4 and kept.kept.summary()["batches_waiting"] == 1
        # the backwards come in two parts: the first waits for the rest of its forward batch
        first = Replies()
        for i in (2, 0):
            kept.submit(TaskKind.BACKWARD, backward(i, run, stage), first.callback(f"s{i}"))
        with pytest.raises(AssertionError):
            first.wait(["s0"], timeout=0.3)
        assert kept.kept.parked() == 2
        late = run_backwards(kept, run, stage, [3, 1])
        results = {**dict(zip(("s2", "s0"), first.wait(["s2", "s0"]))), **dict(zip(("s3", "s1"), late))}
        expected = dict(zip([f"s{i}" for i in range(4)], run_backwards(recomputing, run, stage, [0, 1, 2, 3])))
        for sample_id, result in results.items():
            assert result.step == 0 and result.version == 0
            if stage == 1:
                torch.testing.assert_close(result.grad_input, expected[sample_id].grad_input, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(gradients(kept), gradients(recomputing), rtol=1e-4, atol=1e-6)
        assert kept.counters["backward_kept"] == 4 and recomputing.counters["backward_kept"] == 0
        assert kept.optimizer.samples_accumulated == recomputing.optimizer.samples_accumulated == 4
        assert kept.kept.summary()["bytes_kept"] == 0, "the graph is gone once its backward ran"


def test_an_abandoned_sample_is_a_zero_row_and_its_batch_runs_without_it():
    run = make_run(16)
    with runtimes(run, 1, GIB, 0) as (kept, recomputing):
        run_forwards(kept, run, 1, [0, 1, 2])
        run_forwards(recomputing, run, 1, [0, 1, 2])
        replies = Replies()
        for i in (0, 1):
            kept.submit(TaskKind.BACKWARD, backward(i, run, 1), replies.callback(f"s{i}"))
        kept.abandon(0, "s2")  # its trainer dropped it: its backward will not come
        replies.wait(["s0", "s1"])
        run_backwards(recomputing, run, 1, [0, 1])
        torch.testing.assert_close(gradients(kept), gradients(recomputing), rtol=1e-4, atol=1e-6)
        assert kept.counters["backward_kept"] == 2


def test_a_backward_whose_batch_mates_do_not_come_recomputes_after_the_wait():
    run = make_run(16)
    with runtimes(run, 1, GIB) as (kept,):
        kept.kept.park_s = 0.2
        run_forwards(kept, run, 1, [0, 1])
        [result] = run_backwards(kept, run, 1, [0])
        assert result.step == 0 and kept.optimizer.samples_accumulated == 1
        summary = kept.kept.summary()
        assert summary["samples_recomputed_late"] == 1 and kept.counters["backward_kept"] == 0
        [again] = run_backwards(kept, run, 1, [1])  # its graph is gone: it recomputes at once
        assert again.step == 0 and kept.kept.summary()["samples_recomputed_unkept"] == 1


def test_over_the_budget_the_forward_keeps_nothing_and_backward_recomputes():
    run = make_run(16)
    with runtimes(run, 1, 1024) as (kept,):
        run_forwards(kept, run, 1, [0, 1])
        assert kept.kept.summary()["batches_over_budget"] == 1 and kept.counters["forward_kept"] == 0
        run_backwards(kept, run, 1, [0, 1])
        assert kept.counters["backward_kept"] == 0 and kept.optimizer.samples_accumulated == 2


def test_a_stopping_worker_hands_back_the_backwards_it_parked():
    run = make_run(16)
    kept = make_runtime(run, 1, start=False, kept_activations_bytes=GIB)
    try:
        run_forwards(kept, run, 1, [0, 1])
        replies = Replies()
        kept.submit(TaskKind.BACKWARD, backward(0, run, 1), replies.callback("s0"))
        poll_until(lambda: kept.kept.parked() == 1, 10, "the backward to park")
    finally:
        leftover = kept.stop(5)
    assert [t.payload.sample_id for t in leftover] == ["s0"]
    assert "s0" not in replies.results, "handed back to the worker, which answers it with not_ready"
