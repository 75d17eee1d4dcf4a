"""Exact step boundaries in a worker's compute thread [issue 7]: the tail tags samples with their
global step and never lets a step hold more than the target, other stages accumulate each sample
into the step it is tagged with, late and abandoned samples are accounted, the schedule follows
samples, and a pinned backward recomputes on the weights its forward saw."""

from __future__ import annotations

import time

import copy
import threading

import pytest
import torch

from protocol.messages import BackwardRequest, ForwardRequest
from protocol.run_config import load_run_config
from roles.model.stage import StageModel
from roles.worker.steps.optimizer import StageOptimizer
from roles.worker.serving.queues import TaskKind, TaskQueues
from roles.worker.serving.runtime import StageRuntime
from roles.worker.steps.step_ledger import PeerView, StepLedger
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(60)


def make_run(target: int, **staleness):
    return load_run_config("tiny", {"target_batch_size": target, "staleness": staleness})


def make_runtime(run, stage: int, *, max_batch: int = 16, start: bool = True, **options) -> StageRuntime:
    """A stage runtime as a worker builds it; `options` go to StageRuntime (the head's gate)."""
    model = StageModel(run, stage)
    optimizer = StageOptimizer.for_stage(run, stage, model.trainable_parameters(), "cpu")
    ledger = StepLedger(run.target_batch_size, assigns=model.kind == "tail",
                        close_timeout_s=run.staleness.step_close_timeout_s)
    runtime = StageRuntime(model, optimizer, TaskQueues(max_batch), stage=stage, vocab_size=run.model.vocab_size,
                           max_seq_len=run.model.max_seq_len, device=torch.device("cpu"), ledger=ledger, **options)
    if start:
        runtime.start()
    return runtime


class Replies:
    """Collects on_done callbacks from the compute thread."""

    def __init__(self):
        self.results: dict[str, object] = {}
        self.cond = threading.Condition()

    def callback(self, sample_id: str):
        def on_done(result, exc):
            with self.cond:
                self.results[sample_id] = exc if exc is not None else result
                self.cond.notify_all()
        return on_done

    def wait(self, ids, timeout: float = 20.0):
        with self.cond:
            assert self.cond.wait_for(lambda: all(i in self.results for i in ids), timeout), \
                f"no reply for {[i for i in ids if i not in self.results]}"
        return [self.results[i] for i in ids]


def tokens(i: int, run) -> torch.Tensor:
    return torch.randint(0, run.model.vocab_size, (run.seq_len,), generator=torch.Generator().manual_seed(i))


def coords(i: int, run) -> torch.Tensor:
    return torch.randn(run.seq_len, run.model.subspace_rank, generator=torch.Generator().manual_seed(1000 + i)) * 0.1


def tail_request(i: int, run) -> BackwardRequest:
    return BackwardRequest(stage=run.num_stages - 1, sample_id=f"s{i}", tokens=tokens(i, run), coords=coords(i, run))


def body_backward(i: int, run, step):
    return BackwardRequest(stage=1, sample_id=f"s{i}", tokens=tokens(i, run), coords=coords(i, run),
                           grad_output=coords(2000 + i, run), step=step)


def test_tail_tags_exact_batches_even_when_more_samples_are_queued():
    run = make_run(4)
    runtime = make_runtime(run, run.num_stages - 1, start=False)
    replies = Replies()
    for i in range(6):  # all queued before the compute thread starts: one coalesced batch would hold 6
        runtime.submit(TaskKind.BACKWARD, tail_request(i, run), replies.callback(f"s{i}"))
    runtime.start()
    try:
        results = replies.wait([f"s{i}" for i in range(6)])
        assert [r.step for r in results] == [0, 0, 0, 0, 1, 1]
        poll_until(lambda: runtime.optimizer.local_step == 1, 10, "the compute thread to take step 1")
        assert runtime.optimizer.samples_accumulated == 2, "the two extra samples wait for step 1"
        assert runtime.ledger.step_sizes == [4]
    finally:
        runtime.stop(5)
    assert runtime.discarded_at_shutdown == {1: 2}, "unfinished work is reported at shutdown"


def test_tagged_samples_accumulate_into_their_own_step():
    run = make_run(4)
    runtime = make_runtime(run, 1)
    replies = Replies()
    try:
        for i, step in enumerate([0, 0, 0, 1, 1]):
            runtime.submit(TaskKind.BACKWARD, body_backward(i, run, step), replies.callback(f"s{i}"))
        replies.wait([f"s{i}" for i in range(5)])
        opt = runtime.optimizer
        assert opt.local_step == 0, "step 0 has 3 of its 4 samples"
        assert (opt.samples_accumulated, opt.next_accumulated) == (3, 2)
        runtime.submit(TaskKind.BACKWARD, body_backward(5, run, 2), replies.callback("s5"))
        runtime.submit(TaskKind.BACKWARD, body_backward(6, run, 0), replies.callback("s6"))
        replies.wait(["s6"])
        # step 0 closed on exactly its 4 samples; step 2's sample was held until step 1 opened
        replies.wait(["s5"])
        poll_until(lambda: opt.local_step == 1, 10, "the compute thread to take step 1")
        assert runtime.ledger.step_sizes == [4]
        assert (opt.samples_accumulated, opt.next_accumulated) == (2, 1)
        runtime.submit(TaskKind.BACKWARD, body_backward(7, run, 0), replies.callback("s7"))
        replies.wait(["s7"])
        assert runtime.ledger.late_samples == 1 and runtime.counters["late_samples"] == 1
        assert (opt.samples_accumulated, opt.next_accumulated) == (2, 1), "a late sample's gradient is discarded"
    finally:
        runtime.stop(5)


def test_a_sample_two_steps_ahead_closes_the_open_step():
    """Step 2's sample means the tail closed steps 0 and 1: the missing sample of step 0 was lost
    (with a replica or a trainer), so the stage closes step 0 short rather than stall."""
    run = make_run(2)
    runtime = make_runtime(run, 1)
    replies = Replies()
    try:
        for i, step in [(1, 0), (2, 1), (3, 1)]:
            runtime.submit(TaskKind.BACKWARD, body_backward(i, run, step), replies.callback(f"s{i}"))
        replies.wait(["s1", "s2", "s3"])
        assert runtime.optimizer.local_step == 0
        runtime.submit(TaskKind.BACKWARD, body_backward(0, run, 2), replies.callback("s0"))
        replies.wait(["s0"])
        poll_until(lambda: runtime.optimizer.local_step == 2, 10, "the compute thread to take step 2")
        assert runtime.ledger.step_sizes == [1, 2] and runtime.ledger.reasons["overtaken"] == 1
        assert runtime.optimizer.samples_accumulated == 1, "step 2's sample waited for step 2"
    finally:
        runtime.stop(5)


def test_abandoned_step_closes_short_after_the_timeout():
    run = make_run(4, step_close_timeout_s=0.5)
    runtime = make_runtime(run, 1)
    replies = Replies()
    try:
        for i, step in enumerate([0, 0, 1]):
            runtime.submit(TaskKind.BACKWARD, body_backward(i, run, step), replies.callback(f"s{i}"))
        replies.wait(["s0", "s1", "s2"])
        poll_until(lambda: runtime.optimizer.local_step == 1, 10, "the compute thread to take step 1")
        assert runtime.ledger.step_sizes == [2] and runtime.ledger.reasons["timeout"] == 1
        assert runtime.ledger.summary()["short_steps"] == 1
    finally:
        runtime.stop(5)


def test_the_abandonment_clock_starts_when_later_samples_begin_to_wait():
    """A replica that got no sample of the open step since it started (the other replica took
    them) and now holds samples of the next one waits the whole close timeout from now, not from
    its start: closing at once left a CI run's first step with 4 of 16 samples."""
    ledger = StepLedger(16, assigns=True, close_timeout_s=0.3)
    time.sleep(0.4)  # the worker waited for its first samples longer than the timeout
    assert ledger.due(0, 0, later_waiting=False) is None
    assert ledger.due(0, 0, later_waiting=True) is None, "the clock starts now"
    time.sleep(0.4)
    due = ledger.due(0, 0, later_waiting=True)
    assert due is not None and due.reason == "timeout"
    ledger.stepped(0, due)
    time.sleep(0.4)
    assert ledger.due(1, 0, later_waiting=True) is None, "and again after every step"


def test_a_worker_the_run_left_behind_jumps_to_its_step():
    run = make_run(2)
    runtime = make_runtime(run, 1)
    replies = Replies()
    try:
        runtime.submit(TaskKind.BACKWARD, body_backward(0, run, 40), replies.callback("s0"))
        replies.wait(["s0"])
        assert runtime.optimizer.local_step == 40 and runtime.optimizer.samples_accumulated == 1
        assert runtime.optimizer.samples_consumed == 80, "the schedule follows the run's position"
        assert runtime.ledger.summary()["steps_skipped"] == 40 and runtime.ledger.step_sizes == []
    finally:
        runtime.stop(5)


def test_a_replica_adding_up_gradients_jumps_only_when_no_replica_can_still_close_the_skipped_steps():
    """A replica holding nothing of steps a peer may still close takes them through the exchange
    (its empty contribution, the peer's sum) instead of jumping: a peer pushing its gradients of a
    skipped step would be refused and step on them alone, and the replicas would part (CI: stage 0
    replicas differed after a tail replica was killed)."""
    from roles.worker.steps.gradient_exchange import StepSum

    run = make_run(2)
    # (the peer's open step, the first step this replica exchanges and with how many samples, steps skipped)
    for peer_step, first_exchange, skipped in ((0, (0, 0), 0), (2, (2, 1), 2)):
        runtime = make_runtime(run, 1)
        exchanged = []

        def exchange(own):
            exchanged.append((own.step, own.samples))
            return StepSum(step=own.step, grad=own.grad, samples=own.samples, stage_samples=2,
                           members=("peer", "self"))

        runtime.exchange_step = exchange
        runtime.ledger.update_peers(PeerView(counts={peer_step: 1}, max_step=peer_step, members=("peer",),
                                             records={"peer": (peer_step, 1, 0)}))
        replies = Replies()
        try:
            runtime.submit(TaskKind.BACKWARD, body_backward(0, run, 2), replies.callback("s0"))
            replies.wait(["s0"])
            poll_until(lambda: exchanged, 10, "the compute thread to step with its peer")
            assert exchanged[0] == first_exchange, (peer_step, exchanged)
            assert runtime.ledger.summary()["steps_skipped"] == skipped
        finally:
            runtime.stop(5)

    ledger = StepLedger(2, assigns=False)
    ledger.update_peers(PeerView(counts={}, max_step=5, members=("peer",), records={"peer": (5, 0, 0)}))
    assert ledger.may_jump_to(5)
    ledger.peer_due(3)
    assert not ledger.may_jump_to(5), "a replica pushed its gradients of a step in between"


@pytest.mark.parametrize("x_in_the_sum", [True, False])
def test_corrections_on_an_excluded_replicas_behalf_go_to_the_exchange_with_the_step(x_in_the_sum):
    """A correction held for replica X's sample travels with this replica's contribution; the
    stage's sum takes it when X's gradients are in it, and it is counted either way."""
    from roles.worker.steps.gradient_exchange import Contribution, add_up

    run = make_run(2)
    runtime = make_runtime(run, 1, start=False)
    numel = runtime.optimizer.gradient_numel
    runtime.corrections.add(0, "X", -torch.ones(numel))
    peer = "X" if x_in_the_sum else "Y"
    theirs = Contribution(peer=peer, step=0, samples=1, abandoned=0, grad=torch.ones(numel))
    sent = []

    def exchange(own):
        sent.append(own)
        return add_up(own.step, {"self": own, peer: theirs})

    runtime.exchange_step = exchange
    runtime.ledger.update_peers(PeerView(counts={0: 1}, max_step=0, members=(peer,), records={peer: (0, 1, 0)}))
    replies = Replies()
    runtime.start()
    try:
        runtime.submit(TaskKind.BACKWARD, body_backward(0, run, 0), replies.callback("s0"))
        replies.wait(["s0"])
        poll_until(lambda: runtime.optimizer.local_step == 1, 10, "the compute thread to step with its peer")
        [own] = sent
        assert [(c.peer, c.samples) for c in own.corrections] == [("X", 1)]
        counted = "retractions_summed" if x_in_the_sum else "retractions_replica_gone"
        assert runtime.counters[counted] == 1, dict(runtime.counters)
        assert runtime.corrections.samples(0) == 0
    finally:
        runtime.stop(5)


def test_abandoned_sample_completes_its_step_at_once():
    run = make_run(4)
    runtime = make_runtime(run, 1)
    replies = Replies()
    try:
        for i in range(3):
            runtime.submit(TaskKind.BACKWARD, body_backward(i, run, 0), replies.callback(f"s{i}"))
        replies.wait(["s0", "s1", "s2"])
        assert runtime.optimizer.local_step == 0
        assert runtime.abandon(0), "a trainer dropped the fourth sample below this stage"
        poll_until(lambda: runtime.optimizer.local_step == 1, 10, "the compute thread to take step 1")
        assert runtime.ledger.step_sizes == [4]
        assert runtime.last_step.samples == 3, "the gradient is the mean over the samples that came"
        assert not runtime.abandon(0), "a closed step takes no more notices"
        assert runtime.ledger.summary()["abandoned_samples"] == 1
    finally:
        runtime.stop(5)


def test_replicas_close_on_the_stage_wide_count():
    ledger = StepLedger(8, assigns=True)
    assert ledger.capacity(0, open_samples=3, next_samples=0, max_batch=16) == (5, 0)
    assert ledger.capacity(0, open_samples=3, next_samples=0, max_batch=2) == (2, 0)
    ledger.update_peers(PeerView(counts={0: 5, 1: 6}, max_step=0))
    assert ledger.capacity(0, open_samples=3, next_samples=1, max_batch=16) == (1, 1), "open step full stage-wide"
    due = ledger.due(0, 3, later_waiting=False)
    assert due is not None and due.stage_samples == 8 and due.reason == "complete"
    ledger.update_peers(PeerView(counts={}, max_step=3))
    assert ledger.due(0, 0, later_waiting=False).reason == "peer_ahead"


def test_schedule_follows_samples_not_steps():
    run = make_run(8)
    model = StageModel(run, 1)
    opt = StageOptimizer.for_stage(run, 1, model.trainable_parameters(), "cpu")
    lr = run.optimizer.lr_at
    assert opt.step(stage_samples=12).lr == pytest.approx(lr(0.0))
    assert opt.samples_consumed == 12 and opt.schedule_position == pytest.approx(1.5)
    assert opt.step(stage_samples=4).lr == pytest.approx(lr(1.5))
    assert opt.step().lr == pytest.approx(lr(2.0)), "two uneven steps land where two exact ones would"
    opt.set_step(10)
    assert opt.schedule_position == pytest.approx(10.0)


def test_pinned_backward_recomputes_on_the_forwards_weights():
    run = make_run(2, pin_forward_weights=True)
    runtime = make_runtime(run, 1, start=False)
    replies = Replies()
    v0 = copy.deepcopy(runtime.model)
    # Forward sample 0 on version 0, then let two other samples complete step 0.
    [out] = runtime._forward_batch([ForwardRequest(stage=1, sample_id="s0", tokens=tokens(0, run), coords=coords(0, run))])
    runtime.start()
    try:
        for i in (8, 9):
            runtime.submit(TaskKind.BACKWARD, body_backward(i, run, 0), replies.callback(f"s{i}"))
        replies.wait(["s8", "s9"])
        poll_until(lambda: runtime.optimizer.local_step == 1, 10, "the compute thread to take step 1")
        assert runtime.optimizer.previous_version == 0
        changed = any(not torch.equal(a, b) for a, b in zip(v0.parameters(), runtime.model.parameters()))
        assert changed, "step 0 moved the weights"
        runtime.submit(TaskKind.BACKWARD, body_backward(0, run, 1), replies.callback("s0"))
        [result] = replies.wait(["s0"])
        grads = [p.grad.clone() for p in runtime.optimizer.params]
    finally:
        runtime.stop(5)
    # The reference: the same backward computed by hand on the version-0 weights.
    c = coords(0, run).unsqueeze(0).requires_grad_(True)
    ref_out = v0(c, tokens(0, run).unsqueeze(0))
    torch.testing.assert_close(ref_out[0].detach(), out, rtol=1e-5, atol=1e-6)
    ref_out.backward(coords(2000, run).unsqueeze(0))
    torch.testing.assert_close(result.grad_input, c.grad[0], rtol=1e-5, atol=1e-7)
    for got, param in zip(grads, [p for p in v0.parameters() if p.requires_grad]):
        torch.testing.assert_close(got, param.grad, rtol=1e-5, atol=1e-7)
    assert runtime.staleness.pinned_samples == 1
    assert runtime.staleness.summary()["max_gap"] == 0


def test_without_pinning_the_gap_is_measured():
    run = make_run(1, pin_forward_weights=False)
    runtime = make_runtime(run, 1, start=False)
    runtime._forward_batch([ForwardRequest(stage=1, sample_id="s0", tokens=tokens(0, run), coords=coords(0, run))])
    replies = Replies()
    runtime.start()
    try:
        runtime.submit(TaskKind.BACKWARD, body_backward(9, run, 0), replies.callback("s9"))
        replies.wait(["s9"])
        poll_until(lambda: runtime.optimizer.local_step == 1, 10, "the compute thread to take step 1")
        runtime.submit(TaskKind.BACKWARD, body_backward(0, run, 1), replies.callback("s0"))
        replies.wait(["s0"])
    finally:
        runtime.stop(5)
    summary = runtime.staleness.summary()
    assert summary["max_gap"] == 1 and summary["pinned"] == 0 and summary["stale_share"] == pytest.approx(1.0)


def test_trainers_share_the_in_flight_cap():
    from roles.trainer.role import in_flight_cap

    assert in_flight_cap(4, None, 16, 2) == 4, "no cap: every lane runs"
    assert in_flight_cap(4, 0.25, 16, 2) == 2, "4 in flight over 2 trainers"
    assert in_flight_cap(4, 0.25, 64, 2) == 4, "the lanes still bound it"
    assert in_flight_cap(4, 0.1, 16, 3) == 1, "never below one sample per trainer"


def test_head_gates_forwards_per_weight_version():
    """With max_delayed_per_step 0 the head keeps only as many samples in flight as its open step
    still needs: the next step's samples start on the weights that step produced, so no gradient
    is delayed."""
    run = make_run(2, max_delayed_per_step=0)
    runtime = make_runtime(run, 0, max_delayed_per_step=0)
    replies = Replies()
    try:
        for i in range(3):
            runtime.submit(TaskKind.FORWARD, ForwardRequest(stage=0, sample_id=f"s{i}", tokens=tokens(i, run)),
                           replies.callback(f"f{i}"))
        replies.wait(["f0", "f1"])
        with pytest.raises(AssertionError):
            replies.wait(["f2"], timeout=0.5)
        for i in range(2):
            runtime.submit(TaskKind.BACKWARD, BackwardRequest(stage=0, sample_id=f"s{i}", tokens=tokens(i, run),
                                                              grad_output=coords(i, run), step=0),
                           replies.callback(f"b{i}"))
        replies.wait(["b0", "b1", "f2"])
        assert runtime.optimizer.local_step == 1
        assert runtime.forwarded.peek("s2") == 1, "the third sample ran on the weights after step 0"
        assert runtime.staleness.summary()["max_delay"] == 0
    finally:
        runtime.stop(5)


def test_a_forward_whose_backward_never_comes_stops_holding_the_gate():
    run = make_run(2, max_delayed_per_step=0)
    runtime = make_runtime(run, 0, max_delayed_per_step=0, forward_gate_timeout_s=0.5)
    replies = Replies()
    try:
        for i in range(3):  # s0 and s1 are dropped by their trainer after the forward, with no notice
            runtime.submit(TaskKind.FORWARD, ForwardRequest(stage=0, sample_id=f"s{i}", tokens=tokens(i, run)),
                           replies.callback(f"f{i}"))
        replies.wait(["f0", "f1"])
        replies.wait(["f2"], timeout=10)  # served once the two silent forwards timed out of the gate
        assert runtime.optimizer.local_step == 0
    finally:
        runtime.stop(5)
