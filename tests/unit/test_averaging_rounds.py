"""One round on one replica [report 4.2.2, 5.7.1]: the delta rule keeps the steps taken while the
round ran, a slice that did not come back keeps local values and is reported, a non-finite
average is never applied; and the self-protection rule."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading

import pytest
import torch
from hivemind.averaging.matchmaking import MatchmakingException

from protocol.dht_schema import RoundStatus
from roles.worker.health.round_health import RoundHealth, Verdict
from roles.worker.averaging.index_sets import SegmentIndexSets
from roles.worker.averaging.rounds import RoundPlan, SegmentRound, delta_rule, round_key_bits
from roles.worker.layout import FlatLayout


def test_delta_rule_keeps_local_progress():
    snapshot = torch.tensor([1.0, 2.0, 3.0])
    average = torch.tensor([2.0, 2.0, 0.0])  # what the group agreed on for the snapshot
    later = torch.tensor([1.5, 1.0, 3.25])  # the replica kept training while the round ran
    result = delta_rule(later, snapshot, average)
    assert torch.allclose(result, torch.tensor([2.5, 1.0, 0.25]))
    assert torch.allclose(result - average, later - snapshot), "local update since the snapshot survives"
    assert torch.equal(delta_rule(snapshot, snapshot, average), average), "no progress: plain averaging"


class Store:
    def __init__(self, tensors):
        self.lock = threading.RLock()
        self.master_params = tensors
        self.pushes = 0

    def push_master_to_device(self):
        self.pushes += 1


class FakeAverager:
    """Stands in for the averager process: `step` lets the replica train, then writes an
    `average` into the buffer and reports which reducer slices fell back."""

    def __init__(self, buffer_size, store, *, average_fn, train_fn=None, fell_back=None, error=None, rejected=None,
                 other_values=None):
        self.other_values = other_values
        """What the other member says it sent (its `values` hash); None: the same as this replica."""
        self.buffer = torch.zeros(buffer_size)
        self.store, self.average_fn, self.train_fn = store, average_fn, train_fn
        self.fell_back, self.error = fell_back or {}, error
        self.rejected = rejected or {}
        self.prepared = None

    def leader_window_s(self, due_at):
        return 5.0

    def prepare_round(self, bits, target, leader_window_s=None):
        self.prepared = (bits, target)
        done = concurrent.futures.Future()
        done.set_result(None)
        return done

    @contextlib.contextmanager
    def locked_buffer(self, timeout_s):
        yield self.buffer

    def begin_step(self, weight, gather, leader_window_s=None):
        return (weight, gather)

    def finish_step(self, control):
        return self.step(*control)

    def began_allreduce(self, control):
        return self.error is None

    def step(self, weight, gather):
        if self.train_fn is not None:
            with self.store.lock:
                self.train_fn(self.store.master_params)
        if self.error is not None:
            raise self.error
        size = self.buffer.numel()
        before = self.buffer.clone()
        self.buffer.copy_(self.average_fn(self.buffer))
        half = size // 2
        for peer, lost in self.fell_back.items():  # hivemind leaves failed parts at local values
            self.buffer[size - lost:] = before[size - lost:]
        return {
            "gathered": {"me": dict(gather), "other": {**gather, **({} if self.other_values is None
                                                                   else {"values": self.other_values})}},
            "telemetry": {
                "peers": ["me", "other"], "index": 0, "modes": ["node", "node"], "slice_sizes": [half, size - half],
                "fell_back": self.fell_back, "allreduce_s": 0.1,
                "reducer": {"slice": half, "received": {"me": half, "other": 0 if self.rejected else half},
                            "banned": sorted(self.rejected), "rejected": self.rejected},
            },
        }


def _setup(**fake_kwargs):
    layout = FlatLayout(["a", "b"], [(10, 10), (50,)])
    tensors = [torch.arange(100, dtype=torch.float32).view(10, 10), torch.arange(100, 150, dtype=torch.float32)]
    store = Store(tensors)
    sets = SegmentIndexSets(layout, 5, seed=0, stage=0)
    fake = FakeAverager(sets.buffer_size, store, **fake_kwargs)
    return layout, store, sets, fake, SegmentRound(store, sets, fake)


def _flat(store):
    return torch.cat([t.reshape(-1) for t in store.master_params])


def test_round_applies_the_delta_and_keeps_steps_taken_meanwhile():
    def train(params):  # one optimizer step on every parameter while the round is in flight
        for tensor in params:
            tensor.add_(0.5)

    layout, store, sets, fake, rounds = _setup(average_fn=lambda snap: snap * 0 + 7.0, train_fn=train)
    before = _flat(store).clone()
    plan = RoundPlan("step", 3, 3, 4.0, 2, "active")
    outcome = rounds.run(plan)
    index = sets.get(3).indices
    after = _flat(store)
    assert outcome.status == RoundStatus.COMPLETE, outcome.describe()
    # theta[I] = later + (average - snapshot) = (before + 0.5) + (7 - before) = 7.5
    assert torch.allclose(after[index], torch.full((len(index),), 7.5))
    outside = torch.ones(layout.numel, dtype=torch.bool)
    outside[index] = False
    assert torch.equal(after[outside], before[outside] + 0.5), "other coordinates keep their local progress only"
    assert store.pushes == 1
    assert fake.prepared == (round_key_bits("step", 3, sets.get(3).digest), 2)
    assert outcome.relative_distance is not None and outcome.to_record().averaging_success == 1.0


def test_a_slice_that_did_not_come_back_keeps_local_values_and_is_reported():
    layout, store, sets, fake, rounds = _setup(average_fn=lambda snap: snap + 100.0, fell_back={"other": 6})
    before = _flat(store).clone()
    outcome = rounds.run(RoundPlan("clock", 9, 4, 1.0, 2, "active"))
    index = sets.get(4).indices
    n = len(index)
    moved = _flat(store)[index] - before[index]
    assert torch.all(moved[: n - 6] == 100.0) and torch.all(moved[n - 6:] == 0.0)
    assert outcome.status == RoundStatus.PARTIAL
    record = outcome.to_record()
    [failed] = record.failed_slices
    assert failed.reducer == "other" and failed.failed_elements == 6 and failed.end == sets.buffer_size
    assert record.averaging_success == pytest.approx(1 - 6 / sets.buffer_size)
    assert "did not come back" in record.failure_reason
    assert outcome.delivered_senders == ["other"], "its part reached this reducer: alive, in a repair"


def test_a_round_in_which_no_slice_came_back_whole_failed():
    """A sender the reducers banned mid-send (it stalled) gets a few averaged parts back from each
    before the ban; that is no round it took part in, and the averaging rule must count it."""
    _, _, _, _, rounds = _setup(average_fn=lambda snap: snap + 1.0, fell_back={"me": 1, "other": 2})
    outcome = rounds.run(RoundPlan("clock", 9, 4, 1.0, 2, "active"))
    assert 0 < outcome.averaging_success < 1
    assert outcome.status == RoundStatus.FAILED, outcome.describe()


def test_a_sender_the_reducer_rejected_is_named_in_the_round_report():
    _, _, _, _, rounds = _setup(average_fn=lambda snap: snap, rejected={"other": "values that are not finite"})
    outcome = rounds.run(RoundPlan("clock", 9, 4, 1.0, 2, "active"))
    assert outcome.status == RoundStatus.PARTIAL and outcome.averaging_success == 1.0
    assert outcome.rejected_senders == {"other": "values that are not finite"}
    record = outcome.to_record()
    assert record.banned_senders == ["other"]
    assert "rejected sender(s) ...other (values that are not finite)" in record.failure_reason
    assert "banned sender(s)" not in record.failure_reason, "named once, as rejected"
    assert outcome.delivered_senders == []


def test_a_failed_or_non_finite_round_changes_nothing():
    layout, store, sets, fake, rounds = _setup(average_fn=lambda snap: snap, error=RuntimeError("could not find a group"))
    before = _flat(store).clone()
    outcome = rounds.run(RoundPlan("step", 1, 1, 1.0, 3, "active"))
    assert outcome.status == RoundStatus.FAILED and "no group formed" in outcome.failure_reason
    assert torch.equal(_flat(store), before)

    layout, store, sets, fake, rounds = _setup(average_fn=lambda snap: snap / 0.0 * 0.0)
    before = _flat(store).clone()
    outcome = rounds.run(RoundPlan("step", 2, 2, 0.0, 3, "weight_sync"))
    assert outcome.status == RoundStatus.FAILED and "not finite" in outcome.failure_reason
    assert torch.equal(_flat(store), before)


def test_a_group_this_replica_refused_is_a_failure_marked_as_the_groups():
    refusal = MatchmakingException("Unable to run All-Reduce: refused the group: 1 of its 3 members are not "
                                   "credentialed workers of stage 0 (abcdef: wrong_role)")
    _, store, _, _, rounds = _setup(average_fn=lambda snap: snap, error=refusal)
    before = _flat(store).clone()
    outcome = rounds.run(RoundPlan("step", 1, 1, 1.0, 3, "active"))
    assert outcome.status == RoundStatus.FAILED and outcome.group_refused and "wrong_role" in outcome.failure_reason
    assert torch.equal(_flat(store), before)
    _, _, _, _, rounds = _setup(average_fn=lambda snap: snap, error=RuntimeError("could not find a group"))
    assert not rounds.run(RoundPlan("step", 2, 2, 1.0, 3, "active")).group_refused


def test_group_smaller_than_the_stage_is_partial():
    _, _, _, _, rounds = _setup(average_fn=lambda snap: snap)
    outcome = rounds.run(RoundPlan("step", 1, 0, 1.0, 3, "active"))
    assert outcome.status == RoundStatus.PARTIAL and "3 stage workers expected" in outcome.failure_reason


def test_round_keys_differ_by_round_kind_and_digest():
    keys = {round_key_bits("step", 1, "aa"), round_key_bits("step", 2, "aa"), round_key_bits("clock", 1, "aa"),
            round_key_bits("step", 1, "ab")}
    assert len(keys) == 4 and all(set(key) <= {"0", "1"} and len(key) == 32 for key in keys)


def test_two_failures_in_three_rounds_leave_unless_everyone_failed():
    health = RoundHealth()
    health.record_failure("step", 1)
    assert health.resolve({("step", 1)}) == [(("step", 1), Verdict.FAILURE)]
    assert health.should_leave() is None
    health.record_success()  # a successful round resets the count
    health.record_failure("step", 2)
    health.resolve({("step", 2)})
    assert health.should_leave() is None
    health.record_failure("step", 3)
    health.resolve(set())  # nobody else averaged round 3 either: not this worker's fault
    assert health.should_leave() is None
    health.record_failure("step", 4)
    health.resolve({("step", 4)})
    assert health.should_leave() is not None, "2 of the last 3 rounds failed while the stage averaged"


def test_a_round_edits_the_master_copy_and_pushes_it_to_the_compute_parameters():
    """The path a GPU worker takes: the optimizer keeps separate float32 master weights, the round
    edits those, and the compute parameters follow (here on the CPU, forced)."""
    from roles.worker.steps.optimizer import StageOptimizer

    model = torch.nn.Linear(10, 5)
    optimizer = StageOptimizer(model.parameters(), lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                               warmup_steps=0, total_steps=10, min_lr_ratio=1.0, clip_threshold=1.0, device="cpu",
                               force_master_copy=True)
    assert not optimizer.shares_master
    layout = FlatLayout.of_module(model)
    layout.check(optimizer.master_params)
    sets = SegmentIndexSets(layout, 2, seed=0, stage=0)
    fake = FakeAverager(sets.buffer_size, optimizer, average_fn=lambda snap: snap * 0 + 3.0)
    outcome = SegmentRound(optimizer, sets, fake).run(RoundPlan("step", 1, 1, 1.0, 2, "active"))
    assert outcome.status == RoundStatus.COMPLETE
    compute = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    master = torch.cat([m.reshape(-1) for m in optimizer.master_params])
    assert torch.equal(compute, master), "the compute parameters follow the edited master weights"
    assert torch.all(master[sets.get(1).indices] == 3.0)


def test_a_step_round_averages_the_segment_as_it_was_at_the_boundary_step():
    """Two replicas equal at the boundary, one a step further when its group forms: both average
    the boundary values, get back exactly what they sent and stay equal (a snapshot of the later
    weights would move them apart by half a step each)."""
    _, start, start_sets, _, _ = _setup(average_fn=None)
    boundary = _flat(start)[start_sets.get(3).indices]  # both replicas' values at the boundary
    replicas = []
    for extra_steps in (0, 1):
        # the group's average of two equal snapshots is that snapshot
        layout, store, sets, fake, rounds = _setup(average_fn=lambda snap: boundary.clone())
        sets.get(3)  # prefetched by the service before the boundary
        assert rounds.capture(round_id=3, segment=3)
        for tensor in store.master_params:  # the steps after the boundary, before the snapshot
            tensor.add_(0.25 * extra_steps)
        outcome = rounds.run(RoundPlan("step", 3, 3, 1.0, 2, "active"))
        assert outcome.boundary_snapshot and outcome.delta_sq == 0.0, outcome.describe()
        for tensor in store.master_params:  # the later replica's step reaches the other too
            tensor.add_(0.25 * (1 - extra_steps))
        replicas.append(_flat(store))
    assert torch.equal(replicas[0], replicas[1])


def test_a_step_round_of_replicas_that_all_sent_the_same_values_applies_nothing():
    """The averager's weighted mean of equal values can miss them by a rounding (weights 213 and
    111 moved a replica 2e-8), and such a delta applied a step apart on two replicas parts them.
    When every member sent the values this replica sent, their average is those values."""
    noisy = lambda snap: snap * (1 + 2e-7)  # noqa: E731 - equal values, averaged with rounding
    moved = {}
    for other_values in (None, "another-hash"):
        layout, store, sets, fake, rounds = _setup(average_fn=noisy, other_values=other_values)
        before = _flat(store).clone()
        sets.get(3)
        assert rounds.capture(round_id=3, segment=3)
        outcome = rounds.run(RoundPlan("step", 3, 3, 1.0, 2, "active"))
        moved[other_values] = not torch.equal(_flat(store), before)
        assert outcome.identical == (other_values is None), outcome.describe()
        assert ("replicas identical" in outcome.describe()) == outcome.identical
    assert moved == {None: False, "another-hash": True}


def test_a_boundary_capture_needs_a_computed_index_set_and_matches_only_its_round():
    layout, store, sets, fake, rounds = _setup(average_fn=lambda snap: snap * 0 + 7.0)
    assert not rounds.capture(round_id=3, segment=3), "never builds an index set on the compute thread"
    sets.get(3)
    assert rounds.capture(round_id=3, segment=3)
    outcome = rounds.run(RoundPlan("step", 4, 3, 1.0, 2, "active"))  # another round: the weights now
    assert not outcome.boundary_snapshot
    outcome = rounds.run(RoundPlan("clock", 3, 3, 1.0, 2, "active"))
    assert not outcome.boundary_snapshot
