"""Sync phases [report 3.3.1.1, 5.6]: when a joiner syncs, how it moves from weight sync to
optimizer sync to active (including the early exit on a measured distance), and that optimizer
sync really steps its optimizer on samples that do not count towards the stage's target."""

from __future__ import annotations

import asyncio

import pytest
import torch

from protocol.dht_schema import Phase, ProgressRecord, RoundStatus
from protocol.run_config import SyncConfig
from roles.worker.steps.optimizer import StageOptimizer
from roles.worker.steps.progress import StageProgress
from roles.worker.steps.step_ledger import StepLedger
from roles.worker.state.sync_phase import SyncPhases


def test_only_a_stale_joiner_syncs():
    phases = SyncPhases(SyncConfig(max_stale_steps=20), segments=20)
    assert phases.join_phase(stage_step=100, loaded_step=80) == Phase.ACTIVE
    assert phases.join_phase(stage_step=100, loaded_step=79) == Phase.WEIGHT_SYNC
    no_weight_sync = SyncPhases(SyncConfig(max_stale_steps=0, weight_sync_steps=0), segments=20)
    assert no_weight_sync.join_phase(5, 0) == Phase.OPTIMIZER_SYNC
    nothing = SyncPhases(SyncConfig(max_stale_steps=0, weight_sync_steps=0, optimizer_sync_steps=0), segments=20)
    assert nothing.join_phase(5, 0) == Phase.ACTIVE


def test_a_joiner_with_nobody_to_sync_with_goes_active_from_either_sync_phase():
    phases = SyncPhases(SyncConfig(weight_sync_steps=400, optimizer_sync_steps=100), segments=20)
    phases.begin(Phase.WEIGHT_SYNC, 1000, "stale")
    transition = phases.go_active(1000, 0, 0, "alone")
    assert (transition.old, transition.new, transition.reason) == (Phase.WEIGHT_SYNC, Phase.ACTIVE, "alone")
    assert phases.go_active(1001, 0, 0, "alone") is None, "already active"
    phases.begin(Phase.OPTIMIZER_SYNC, 1000, "synced")
    assert phases.go_active(1010, 5, 5, "alone").old == Phase.OPTIMIZER_SYNC
    spans = phases.summary()
    assert [s["phase"] for s in spans] == ["weight_sync", "active", "optimizer_sync", "active"]
    assert spans[2]["to_step"] == 1010 and spans[2]["backward_requests"] == 5


def test_a_diverged_replica_resyncs_until_a_full_pass_of_complete_rounds_replaced_its_weights():
    phases = SyncPhases(SyncConfig(weight_sync_steps=400, optimizer_sync_steps=0), segments=3)
    phases.begin(Phase.ACTIVE, 0, "fresh")
    transition = phases.resync(50, 10, 10, "outlier")
    assert (transition.old, transition.new) == (Phase.ACTIVE, Phase.WEIGHT_SYNC)
    assert phases.resync(51, 10, 10, "outlier") is None, "only an active replica resyncs"
    phases.record_round(0, RoundStatus.COMPLETE, 1.0, 1.0)
    phases.record_round(1, RoundStatus.PARTIAL, 1.0, 1.0)  # a slice stayed local: not replaced
    phases.record_round(2, RoundStatus.COMPLETE, 1.0, 1.0)
    assert phases.update(52, 10, 10) is None
    phases.record_round(1, RoundStatus.COMPLETE, 1.0, 1.0)
    done = phases.update(53, 10, 10)
    assert done.new == Phase.ACTIVE and "replaced the diverged weights" in done.reason
    phases.begin(Phase.WEIGHT_SYNC, 60, "stale joiner")
    for segment in range(3):
        phases.record_round(segment, RoundStatus.COMPLETE, 1.0, 1.0)
    assert phases.update(61, 0, 0) is None, "a joiner's weight sync does not end on a pass"


def test_weight_sync_then_optimizer_sync_then_active_by_steps():
    phases = SyncPhases(SyncConfig(weight_sync_steps=400, optimizer_sync_steps=100), segments=20)
    phases.begin(Phase.WEIGHT_SYNC, 1000, "stale")
    assert phases.update(1399, 0, 0) is None and phases.phase == Phase.WEIGHT_SYNC
    transition = phases.update(1400, 0, 0)
    assert (transition.old, transition.new) == (Phase.WEIGHT_SYNC, Phase.OPTIMIZER_SYNC)
    assert phases.update(1499, 40, 40) is None
    assert phases.update(1500, 64, 64).new == Phase.ACTIVE
    spans = phases.summary()
    assert [s["phase"] for s in spans] == ["weight_sync", "optimizer_sync", "active"]
    assert spans[0]["forward_requests"] == 0 and spans[1]["backward_requests"] == 64


def test_weight_sync_ends_early_once_a_full_pass_moved_the_replica_little():
    phases = SyncPhases(SyncConfig(weight_sync_steps=400, weight_sync_exit_distance=1e-3), segments=4)
    phases.begin(Phase.WEIGHT_SYNC, 0, "stale")
    for segment in range(3):  # not a full pass yet, however small the moves
        phases.record_round(segment, RoundStatus.COMPLETE, delta_sq=1e-12, average_sq=1.0)
    assert phases.update(60, 0, 0) is None
    phases.record_round(3, RoundStatus.FAILED, delta_sq=0.0, average_sq=1.0)  # failed rounds say nothing
    assert phases.update(61, 0, 0) is None
    phases.record_round(3, RoundStatus.COMPLETE, delta_sq=1e-2, average_sq=1.0)  # still far: sqrt(0.01) = 0.1
    assert phases.update(62, 0, 0) is None
    phases.record_round(3, RoundStatus.PARTIAL, delta_sq=1e-8, average_sq=1.0)
    transition = phases.update(80, 0, 0)
    assert transition.new == Phase.OPTIMIZER_SYNC and "full pass" in transition.reason


def _optimizer():
    model = torch.nn.Linear(4, 1)
    opt = StageOptimizer(model.parameters(), lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, warmup_steps=0,
                         total_steps=10, min_lr_ratio=1.0, clip_threshold=10.0, device="cpu")
    return model, opt


def test_a_syncing_replica_steps_on_its_own_gradients():
    model, opt = _optimizer()
    before = model.weight.detach().clone()
    model(torch.ones(3, 4)).sum().backward()
    opt.add_samples(3)
    assert opt.samples_accumulated == 3
    report = opt.step()
    assert report.samples == 3 and report.grad_norm > 0
    assert not torch.equal(model.weight, before), "the optimizer stepped on its own gradients"
    assert opt.samples_accumulated == 0


class FakeSwarm:
    peer_id = "me"

    def __init__(self, peers):
        self.peers = peers
        self.stored = {}

    async def store(self, key, record, ttl):
        self.stored[key] = record
        return True

    async def get(self, key, model, strict=False):
        return dict(self.peers)


@pytest.mark.timeout(30)
def test_progress_counts_every_tagged_sample_of_the_step():
    """A replica in optimizer sync serves samples the tail tagged into the step; the step is not
    complete at this stage without them, though they update only the syncing replica's weights."""
    _, opt = _optimizer()
    opt.add_samples(2)
    peer = ProgressRecord(local_step=0, samples_accumulated=5, counts_towards_target=True, time=0.0)
    swarm = FakeSwarm({"peer": peer})
    ledger = StepLedger(8, assigns=False)
    progress = StageProgress(swarm, "run", 0, opt, ledger, counts_towards_target=lambda: False)
    asyncio.run(progress.tick(force=True))
    assert ledger.peers.counts[0] == 5
    assert ledger.due(opt.local_step, opt.samples_accumulated, later_waiting=False) is None, "7 of 8 samples"
    published = next(iter(swarm.stored.values()))
    assert published.samples_accumulated == 2 and published.counts_towards_target is False
    opt.add_samples(1)
    assert ledger.due(opt.local_step, opt.samples_accumulated, later_waiting=False).stage_samples == 8


@pytest.mark.timeout(30)
def test_an_idle_replica_reads_its_stage_slowly_and_the_next_sample_makes_it_quick(monkeypatch):
    """Issue 23 (the idle swarm's DHT cost): counts unchanged for IDLE_AFTER_S -> reads every
    idle period (alone: a tick inside it reads nothing); a change -> back to `period_s` at once."""
    from roles.worker.steps import progress as progress_module

    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    _, opt = _optimizer()
    reads = []

    class CountingSwarm(FakeSwarm):
        async def get(self, key, model, strict=False):
            reads.append(now[0])
            return {}

    progress = StageProgress(CountingSwarm({}), "run", 0, opt, StepLedger(8, assigns=False), period_s=0.25)
    asyncio.run(progress.tick())
    assert progress.current_period_s() == 0.25
    now[0] += progress_module.IDLE_AFTER_S
    assert progress.current_period_s() == progress_module.IDLE_PERIOD_S
    asyncio.run(progress.tick())
    assert len(reads) == 2
    now[0] += 0.5
    asyncio.run(progress.tick())
    assert len(reads) == 2, "idle and alone: no read within the idle period"
    now[0] += progress_module.IDLE_PERIOD_S
    asyncio.run(progress.tick())
    assert len(reads) == 3
    opt.add_samples(1)  # a sample arrived
    now[0] += 0.3
    asyncio.run(progress.tick())
    assert progress.current_period_s() == 0.25 and len(reads) == 4


@pytest.mark.timeout(30)
def test_a_replica_asked_by_a_peer_it_does_not_know_reads_its_stage_once_for_all_askers(monkeypatch):
    """A replica that found our progress record before we found its asks at once (tags, step
    gradients); `read_soon` reads the stage for it: one read for every ask under way, none again
    within MIN_REREAD_S, and the newcomer is a member afterwards."""
    from roles.worker.steps import progress as progress_module

    _, opt = _optimizer()
    reads = []
    newcomer = ProgressRecord(local_step=0, samples_accumulated=1, counts_towards_target=True, time=0.0)

    class SlowSwarm(FakeSwarm):
        async def get(self, key, model, strict=False):
            reads.append(key)
            await asyncio.sleep(0.05)
            return dict(self.peers)

    swarm = SlowSwarm({})
    ledger = StepLedger(8, assigns=False)
    progress = StageProgress(swarm, "run", 0, opt, ledger)

    async def scenario():
        await progress.tick(force=True)
        assert ledger.peers.members == ()
        swarm.peers["newcomer"] = newcomer
        await asyncio.sleep(progress_module.MIN_REREAD_S)
        await asyncio.gather(*(progress.read_soon() for _ in range(5)))
        assert len(reads) == 2, "five askers, one read"
        assert ledger.peers.members == ("newcomer",)
        await progress.read_soon()
        assert len(reads) == 2, "a read that just ended is not repeated"

    asyncio.run(scenario())
