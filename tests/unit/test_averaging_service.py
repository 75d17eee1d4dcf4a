"""The averaging service's decisions, without an averager process: when a round is due, when it
is skipped and why, and when failed rounds make a worker leave its stage [report 3.3.1.6]."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from protocol.dht_schema import AveragingRecord, Phase, RoundStatus, RoundSummaryRecord, WorkerRecord
from protocol.messages import to_body
from protocol.run_config import AveragingConfig
from roles.worker.averaging.index_sets import SegmentIndexSets
from roles.worker.averaging.rounds import RoundOutcome, RoundPlan
from roles.worker.averaging.schedule import RoundSchedule
from roles.worker.averaging.service import AveragingService
from roles.worker.layout import FlatLayout


class FakeSwarm:
    peer_id = "me"

    def __init__(self):
        self.workers: dict[str, WorkerRecord] = {}
        self.averaging: dict[str, AveragingRecord] = {}

    async def get(self, key, model):
        return dict(self.workers if model is WorkerRecord else self.averaging)

    async def store(self, key, record, ttl):
        return True

    def withdrawn(self, key):
        return False


class Store:
    lock = threading.RLock()
    master_params = [torch.zeros(40)]

    def push_master_to_device(self):
        pass


def _service(swarm, *, reducer=True, phase=Phase.ACTIVE, **config):
    step = {"value": 0}
    service = AveragingService(
        AveragingConfig(**config), swarm=swarm, run_id="run", stage=0, store=Store(),
        index_sets=SegmentIndexSets(FlatLayout(["w"], [(40,)]), 4, seed=0, stage=0), reducer=reducer,
        local_step=lambda: step["value"], phase=lambda: phase, samples_processed=lambda: 0,
    )
    return service, step


def _worker(phase=Phase.ACTIVE):
    return WorkerRecord(stage=0, phase=phase, max_batch=1, throughput=1.0)


def test_step_rounds_fire_at_boundaries_reached_by_stepping_not_by_jumping():
    schedule = RoundSchedule(average_every=20)
    schedule.begin(0)
    assert schedule.due(19) is None
    assert schedule.due(20) == ("step", 1)
    assert schedule.due(21) is None, "one round per boundary"
    assert schedule.due(43) == ("step", 2), "a few steps late (slow poll) still counts"
    assert schedule.due(97) is None, "jumped to the stage's step: its peers averaged long ago"
    assert schedule.due(100) == ("step", 5)
    joiner = RoundSchedule(average_every=20)
    joiner.begin(57)
    assert joiner.due(57) is None and joiner.due(60) == ("step", 3)


def test_idle_stages_average_on_the_clock():
    schedule = RoundSchedule(average_every=20, idle_period_s=1.0)
    schedule.begin(0)
    now = time.monotonic()
    assert schedule.due(0, now + 0.5) is None, "not idle for a period yet"
    schedule.last_clock_tick -= 1
    kind, tick = schedule.due(0, now + 2.0)
    assert kind == "clock" and tick == int(time.time())
    assert schedule.due(0, now + 2.1) is None, "once per tick"
    assert schedule.due(1, now + 2.2) is None, "a step resets the idle timer"


def test_the_service_wakes_for_the_next_clock_round_not_on_a_timer():
    assert RoundSchedule(average_every=20).seconds_to_clock_round() is None, "without an idle period: steps only"
    schedule = RoundSchedule(average_every=20, idle_period_s=1.0)
    schedule.begin(0)
    now = time.monotonic()
    assert 0.9 < schedule.seconds_to_clock_round(now) <= 1.0, "idle for a period first"
    schedule.last_clock_tick -= 1  # as if the current tick had not been averaged yet
    assert schedule.seconds_to_clock_round(now + 2.0) == 0.0
    assert schedule.due(0, now + 2.0)[0] == "clock"
    assert schedule.seconds_to_clock_round(now + 2.0) > 0, "this tick is done: wait for the next"


def test_rounds_are_skipped_with_a_reason():
    swarm = FakeSwarm()
    service, _ = _service(swarm, reducer=False)
    view = asyncio.run(service._stage_view(Phase.ACTIVE))
    assert service._skip_reason(view) == "alone in the stage"
    swarm.workers = {"me": _worker(), "peer": _worker()}
    swarm.averaging = {"peer": AveragingRecord(reducer=False)}
    view = asyncio.run(service._stage_view(Phase.ACTIVE))
    assert view.expected == 2 and "--reducer" in service._skip_reason(view)
    swarm.averaging = {"peer": AveragingRecord(reducer=True)}
    swarm.workers["peer"] = _worker(Phase.WEIGHT_SYNC)
    view = asyncio.run(service._stage_view(Phase.OPTIMIZER_SYNC))
    assert service._skip_reason(view) == "no active replica in the stage to average with"
    view = asyncio.run(service._stage_view(Phase.ACTIVE))
    assert service._skip_reason(view) == ""
    swarm.workers["gone"] = _worker(Phase.LEAVING)
    assert asyncio.run(service._stage_view(Phase.ACTIVE)).expected == 2, "leaving workers are not expected"


def test_a_round_the_others_skip_at_their_stride_is_skipped_and_not_waited_for():
    """Replicas whose rounds ran long publish a stride (every 2nd, 4th.. round). In the lab's reducer
    preemption, the surviving reducer ran the rounds its contributors skipped, alone, and reported
    each as a failed round after a matchmaking window spent waiting for them."""
    swarm = FakeSwarm()
    service, _ = _service(swarm, reducer=True)
    swarm.workers = {"me": _worker(), "a": _worker(), "b": _worker(), "new": _worker()}
    swarm.averaging = {"a": AveragingRecord(stride=4), "b": AveragingRecord(stride=2)}  # "new": no record yet
    odd = asyncio.run(service._stage_view(Phase.ACTIVE, 3))
    assert odd.off_cadence == {"a", "b"} and odd.running == 2, "nobody waits for a and b in round 3"
    assert service._skip_reason(odd) == "", "the worker without a record yet counts as running it"
    del swarm.workers["new"]
    odd = asyncio.run(service._stage_view(Phase.ACTIVE, 3))
    assert service._skip_reason(odd) == "every other replica of the stage skips this round at its cadence"
    two = asyncio.run(service._stage_view(Phase.ACTIVE, 2))
    assert two.off_cadence == {"a"} and two.running == 2 and service._skip_reason(two) == ""
    assert asyncio.run(service._stage_view(Phase.ACTIVE, 4)).running == 3
    assert asyncio.run(service._stage_view(Phase.ACTIVE)).running == 3, "a repair round is not strided"

    sender, _ = _service(swarm, reducer=False)
    swarm.averaging = {"a": AveragingRecord(reducer=True, stride=2), "b": AveragingRecord()}
    odd = asyncio.run(sender._stage_view(Phase.ACTIVE, 3))
    assert sender._skip_reason(odd) == "every reducer of the stage skips this round at its cadence"
    assert sender.record().stride == 1
    sender.schedule.overran()
    assert sender.record().stride == 2, "the stride is published"


def _failed(round_id):
    return RoundOutcome(RoundPlan("step", round_id, round_id % 4, 1.0, 2, "active"), "d", RoundStatus.FAILED,
                        failure_reason="no group formed within the matchmaking window")


def _survived(round_id):
    return RoundSummaryRecord(kind="step", round=round_id, segment=round_id % 4, digest="d",
                              status=RoundStatus.COMPLETE, group_size=1, expected_group_size=2, duration_s=1.0,
                              weight=1.0)


def test_a_worker_leaves_after_failing_two_rounds_the_stage_survived():
    swarm = FakeSwarm()
    swarm.workers = {"me": _worker(), "peer": _worker()}
    service, _ = _service(swarm)
    service._finish(_failed(1))
    swarm.averaging = {"peer": AveragingRecord(reducer=True, recent=[])}
    service._resolve_health(asyncio.run(service._stage_view(Phase.ACTIVE)))
    assert service.leave_reason is None and service.health.failures == 0, "nobody averaged round 1: neutral"
    service._finish(_failed(2))
    service._finish(_failed(3))
    swarm.averaging = {"peer": AveragingRecord(reducer=True, recent=[_survived(2), _survived(3)])}
    service._resolve_health(asyncio.run(service._stage_view(Phase.ACTIVE)))
    assert service.leave_reason and "the limit is 2 of 3" in service.leave_reason
    assert service.counters["rounds_failed"] == 3
    record = service.record()
    assert record.rounds_failed == 3 and [r.round for r in record.recent] == [1, 2, 3]


def test_refusals_and_rejected_senders_reach_the_counters_and_the_summary(tmp_path):
    from protocol.auth_state import SharedAuthState
    from roles.worker.averaging.access import Refusal

    state = SharedAuthState(str(tmp_path / "trust"), run_id="run", root_public_key=b"\x00" * 32)
    service = AveragingService(
        AveragingConfig(), swarm=FakeSwarm(), run_id="run", stage=0, store=Store(),
        index_sets=SegmentIndexSets(FlatLayout(["w"], [(40,)]), 4, seed=0, stage=0), reducer=True,
        local_step=lambda: 0, phase=lambda: Phase.ACTIVE, samples_processed=lambda: 0, auth_state=state)
    service.access.refuse(Refusal.WRONG_STAGE, "a worker of stage 1")
    service.access.refuse(Refusal.UNVERIFIED, "a part")
    plan = RoundPlan("clock", 1, 1, 1.0, 3, "active")
    service._finish(RoundOutcome(plan, "d", RoundStatus.PARTIAL, group=["me", "a", "b"], banned_senders=["b"],
                                 rejected_senders={"b": "values that are not finite"}))
    counters = service.counters
    assert counters["averaging_refused_wrong_stage"] == 1 and counters["averaging_refused_unverified"] == 1
    assert counters["senders_rejected"] == 1 and counters["rounds_partial"] == 1
    summary = service.summary()
    assert summary["refused"] == {"wrong_stage": 1, "unverified": 1}
    assert summary["rounds"][0]["rejected_senders"] == {"b": "values that are not finite"}
    assert summary["rounds"][0]["banned_senders"] == ["b"]
    open_run, _ = _service(FakeSwarm())
    assert open_run.access is None and open_run.summary()["refused"] == {}


def test_a_refused_group_does_not_count_against_the_replica():
    """A credentialed trainer posing as the stage's leader makes honest followers refuse its group;
    that must not push them out of their stage [report 3.3.1.6]."""
    service, _ = _service(FakeSwarm())
    for round_id in (1, 2, 3):
        plan = RoundPlan("step", round_id, round_id % 4, 1.0, 3, "active")
        service._finish(RoundOutcome(plan, "d", RoundStatus.FAILED, group_refused=True,
                                     failure_reason="MatchmakingException: Unable to run All-Reduce: refused the "
                                                    "group"))
    assert service.health.pending == [] and service.counters["rounds_failed"] == 3


def test_rounds_that_outlast_their_interval_make_the_stage_average_every_other_round_until_they_fit_again():
    schedule = RoundSchedule(average_every=20)
    schedule.begin(0)
    for k in range(1, 4):
        assert schedule.due(20 * k, now=10.0 * k) == ("step", k)
    assert schedule.interval_s == pytest.approx(10.0)
    assert all(schedule.runs(k) for k in range(8))
    schedule.finished("step", 14.0)
    schedule.overran()
    assert schedule.stride == 2 and [k for k in range(8) if schedule.runs(k)] == [0, 2, 4, 6]
    schedule.finished("step", 14.0)
    assert schedule.stride == 2, "rounds still take longer than one interval"
    for _ in range(3):
        schedule.finished("step", 5.0)
    assert schedule.stride == 2, "the long rounds still count: the stride must not halve right after it doubled"
    schedule.finished("step", 5.0)
    assert schedule.stride == 1, "the last 4 rounds fit one interval again"
    for _ in range(10):
        schedule.overran()
    assert schedule.stride == 16, "at least every 16th round runs"
    assert "every 16th round" in schedule.cadence()


class ScriptedRounds:
    """Stands in for SegmentRound: a "lonely" round looks for a group nobody else is in until the
    test ends its matchmaking window; a "long" one found its group and runs its all-reduce until
    the test releases it."""

    def __init__(self, script):
        self.script = script
        self.ran: list[int] = []
        self.in_allreduce = False
        self.window_ends = threading.Event()
        self.release = threading.Event()

    def run(self, plan):
        self.ran.append(plan.round)
        if self.script[plan.round] == "lonely":
            assert self.window_ends.wait(10)
            return RoundOutcome(plan, "d", RoundStatus.FAILED, 22.5,
                                failure_reason="no group formed within the matchmaking window")
        self.in_allreduce = True
        assert self.release.wait(10)
        self.in_allreduce = False
        return RoundOutcome(plan, "d", RoundStatus.COMPLETE, 12.0, group=["me", "peer"], averaging_success=1.0,
                            allreduce_began=True)


async def _until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_round_that_falls_due_while_the_last_one_looks_for_its_group_runs_late_not_never():
    """In the lab's preemptions, a replica that read a peer's stride a moment before the peer
    doubled it ran a round alone for its whole matchmaking deadline, skipped the next rounds as
    overran (doubling its stride), and from then on ran rounds alone, out of step with its peers.
    A round that falls due while the last one still looks for its group now runs after it, and
    doubles nothing; one that falls due during an all-reduce is skipped and doubles the stride once."""
    from roles.worker.averaging.service import AveragingState, _SerialThread

    async def main():
        swarm = FakeSwarm()
        swarm.workers = {"me": _worker(), "peer": _worker()}
        swarm.averaging = {"peer": AveragingRecord(reducer=True)}
        service, step = _service(swarm, average_every=10)
        rounds = service.rounds = ScriptedRounds({2: "lonely", 4: "long"})
        service._thread = _SerialThread("test-averaging")
        service.state = AveragingState.READY
        service.schedule.begin(0)
        service.schedule.stride = 2
        try:
            def due(k):
                step["value"] = 10 * k
                service._poll()

            due(1)  # off the stride
            due(2)
            await _until(lambda: rounds.ran == [2])
            due(3)  # off the stride while round 2 looks: skipped at the cadence, nothing overran
            due(4)  # waits for round 2
            due(5)
            due(6)  # round 4 already waits: skipped
            assert rounds.ran == [2] and service.counters["rounds_overran"] == 0 and service.schedule.stride == 2
            rounds.window_ends.set()
            await _until(lambda: rounds.in_allreduce)
            assert rounds.ran == [2, 4]
            assert service.schedule.round_s is None, "a round without a group says nothing about round length"
            due(8)  # during round 4's all-reduce: overran, the stride doubles
            due(12)
            rounds.release.set()
            await _until(lambda: service._round_task.done() and service.state == AveragingState.READY)
            ran = [(o.plan.round, o.status) for o in service.history if "cadence" not in o.failure_reason]
            assert ran == [(6, RoundStatus.SKIPPED), (2, RoundStatus.FAILED), (8, RoundStatus.SKIPPED),
                           (12, RoundStatus.SKIPPED), (4, RoundStatus.COMPLETE)], ran
            reasons = {o.plan.round: o.failure_reason for o in service.history}
            assert "still looking for its group" in reasons[6] and "cadence" in reasons[3] and "cadence" in reasons[5]
            assert all("still running" in reasons[k] for k in (8, 12))
            assert service.counters["rounds_overran"] == 2 and service.schedule.stride == 4, "doubled once"
            assert rounds.ran == [2, 4] and service.schedule.round_s == 12.0
        finally:
            service._thread.close()

    asyncio.run(main())


def test_a_round_that_could_start_only_after_the_others_assembled_is_skipped_not_run_alone():
    """A chained round that could start only once the others' groups have assembled would run
    alone and push the next round late too: a sender that joined late ran two rounds that way and
    left its stage by the averaging rule (CI). It is skipped instead, and nothing doubles."""
    import types

    from roles.worker.averaging.service import AveragingState, _SerialThread

    async def main():
        swarm = FakeSwarm()
        swarm.workers = {"me": _worker(), "peer": _worker()}
        swarm.averaging = {"peer": AveragingRecord(reducer=True)}
        service, step = _service(swarm, average_every=10)
        rounds = service.rounds = ScriptedRounds({1: "lonely"})
        service.averager = types.SimpleNamespace(latest_start_s=lambda: 0.0)
        service._thread = _SerialThread("test-averaging")
        service.state = AveragingState.READY
        service.schedule.begin(0)
        try:
            step["value"] = 10
            service._poll()
            await _until(lambda: rounds.ran == [1])
            step["value"] = 20
            service._poll()
            rounds.window_ends.set()
            await _until(lambda: service._round_task.done() and len(service.history) == 2)
            late = service.history[-1]
            assert late.plan.round == 2 and late.status == RoundStatus.SKIPPED and "too late" in late.failure_reason
            assert rounds.ran == [1] and service.schedule.stride == 1 and service.counters["rounds_overran"] == 0
        finally:
            service._thread.close()

    asyncio.run(main())


def test_a_peer_with_another_index_set_is_named_even_when_it_announced_the_round_late():
    """Peers with other index sets never meet this replica; it names them from the digests they
    announce. An integration run caught a peer that reached each round after this replica had
    looked, so the rounds it already finished count too."""
    def summary(round_id, digest):
        return RoundSummaryRecord(kind="clock", round=round_id, segment=0, digest=digest, status=RoundStatus.FAILED,
                                  group_size=0, expected_group_size=3, duration_s=2.0, weight=1.0)

    swarm = FakeSwarm()
    service, _ = _service(swarm)
    service._finish(RoundOutcome(RoundPlan("clock", 7, 3, 1.0, 3, "active"), "d7", RoundStatus.PARTIAL))
    outcome = RoundOutcome(RoundPlan("clock", 8, 0, 1.0, 3, "active"), "d8", RoundStatus.PARTIAL)
    swarm.averaging = {
        "late": AveragingRecord(round_kind="clock", round=9, digest="x9", recent=[summary(7, "x7")]),
        "now": AveragingRecord(round_kind="clock", round=8, digest="x8"),
        "same": AveragingRecord(round_kind="clock", round=8, digest="d8", recent=[summary(7, "d7")]),
        "fresh": AveragingRecord(),
    }
    asyncio.run(service._check_index_sets(outcome))
    assert outcome.mismatched_peers == ["late", "now"]
    assert service.counters["index_set_mismatches"] == 2


@pytest.mark.parametrize("stride", [1, 2, 4, 8, 16])
def test_every_stride_reaches_every_segment(stride):
    from roles.worker.averaging.schedule import segment_of

    segments = 20
    assert sorted(segment_of(k, segments) for k in range(segments)) == list(range(segments)), "a pass is a permutation"
    reached = {segment_of(k, segments) for k in range(0, stride * segments * segments, stride)}
    assert reached == set(range(segments))


class _ForkThatMayHang:
    """Stands in for the averager process: a real child that serves at once, or never."""

    def __init__(self, hang: bool):
        import multiprocessing as mp

        self._ready = mp.get_context("fork").Event()
        self.process = mp.get_context("fork").Process(target=self._serve, args=(hang,), daemon=True)

    def _serve(self, hang: bool) -> None:
        if not hang:
            self._ready.set()
        time.sleep(60)

    def start(self):
        self.process.start()

    def wait_until_ready(self, timeout_s):
        if not self._ready.wait(timeout_s):
            raise TimeoutError("not ready")

    def is_alive(self):
        return self.process.is_alive()

    def kill(self):
        self.process.kill()

    def join(self, timeout_s):
        self.process.join(timeout_s)


def _averager_with_forks(monkeypatch, hangs):
    from roles.worker.averaging.averager import StageAverager

    forks = []

    def new_process(self):
        forks.append(_ForkThatMayHang(hangs[len(forks)]))
        return forks[-1]

    monkeypatch.setattr(StageAverager, "_new_process", new_process)
    return StageAverager(None, 8, run_id="r", stage=0, reducer=False, config=AveragingConfig()), forks


def test_an_averager_fork_that_hangs_is_killed_and_forked_again(monkeypatch):
    averager, forks = _averager_with_forks(monkeypatch, [True, False])
    averager.start(timeouts_s=(0.5, 10.0))
    assert len(forks) == 2 and averager.process is forks[1]
    assert forks[0].process.exitcode is not None, "the hung fork must be gone"
    assert forks[1].is_alive()
    forks[1].kill()


def test_an_averager_that_never_serves_is_an_error_not_a_hang(monkeypatch):
    from roles.worker.errors import AveragingError

    averager, forks = _averager_with_forks(monkeypatch, [True, True])
    with pytest.raises(AveragingError, match="attempt 2 of 2"):
        averager.start(timeouts_s=(0.3, 0.3))
    assert all(fork.process.exitcode is not None for fork in forks)


def test_a_repair_counts_in_a_reducer_whose_slice_timed_out_here_but_whose_part_arrived():
    """Replicas a, b and me; a died mid-round, and b's slice did not come back here either because
    b waited out a before it answered. b's own part reached this reducer whole, so b is alive: the
    repair is among b and me. Without that part, b counts as lost too and nothing is repaired."""
    from protocol.dht_schema import FailedSliceRecord

    service, _ = _service(FakeSwarm())
    plan = RoundPlan("clock", 5, 1, 1.0, 3, "active")
    failed = [FailedSliceRecord(reducer="a", start=0, end=10, failed_elements=10),
              FailedSliceRecord(reducer="b", start=10, end=20, failed_elements=4)]
    seen = RoundOutcome(plan, "d", RoundStatus.PARTIAL, group=["a", "b", "me"], failed_slices=failed,
                        banned_senders=["a"], delivered_senders=["b"])
    repair = service._repair_plan(seen)
    assert repair is not None and repair.kind == "repair" and repair.round == 5 and repair.segment == 1
    assert repair.expected_group_size == 2
    unseen = RoundOutcome(plan, "d", RoundStatus.PARTIAL, group=["a", "b", "me"], failed_slices=failed,
                          banned_senders=["a"])
    assert service._repair_plan(unseen) is None
    only_a = RoundOutcome(plan, "d", RoundStatus.PARTIAL, group=["a", "b", "me"], failed_slices=failed[:1])
    assert service._repair_plan(only_a).expected_group_size == 2


def test_a_round_s_part_evidence_is_reported_once_and_not_kept_in_the_history():
    """What the averager process found against a poisoning sender goes to the reporter, once per
    accused and round, off the round's path; the outcome kept in the history drops its bytes."""
    from tests.unit.test_part_evidence import _evidence, _identity, _signed

    liar, a, b = (_identity() for _ in range(3))
    evidence = _evidence(_signed(liar, 1000.0), _signed(a, seed=1), _signed(b, seed=2))
    sent = []

    async def report(found):
        sent.append(found)
        return "upheld"

    service = AveragingService(
        AveragingConfig(), swarm=FakeSwarm(), run_id="run-p", stage=0, store=Store(),
        index_sets=SegmentIndexSets(FlatLayout(["w"], [(40,)]), 4, seed=0, stage=0), reducer=True,
        local_step=lambda: 0, phase=lambda: Phase.ACTIVE, samples_processed=lambda: 0,
        sign=a.sign, report_evidence=report)
    async def rounds():
        for kind in ("clock", "repair"):  # the round's repair finds the liar again: not reported twice
            service._finish(RoundOutcome(RoundPlan(kind, 11, 1, 1.0, 3, "active"), "d", RoundStatus.PARTIAL,
                                         rejected_senders={evidence.accused.peer_id: "norm"}, unsigned_parts=2,
                                         part_evidence=[to_body(evidence)]))
        await service.parts_reporter.close()

    asyncio.run(rounds())
    assert sent == [evidence] and service.summary()["evidence"] == {"upheld": 1}
    assert all(outcome.part_evidence == [] for outcome in service.history)
    assert service.counters["parts_unsigned"] == 4
    unsigned, _ = _service(FakeSwarm())
    assert unsigned.parts_reporter is None and unsigned.summary()["evidence"] == {}, "an open run reports nothing"
