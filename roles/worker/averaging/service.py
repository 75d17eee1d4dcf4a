"""With whom a replica averages, at what weight, and how it reports it [report 4.2, 5.7].

When a round is due (schedule.py), the service reads the stage from the DHT: its workers (the
expected group size), who reduces, who is active. A stage with fewer reducers than
`averaging.min_reducers` elects its most stable active workers (election.py), and an elected
sender promotes itself before the round. A replica alone in its stage, or in a stage without a
reducer (none could be elected), skips the round and says why. A round that lost a dead reducer's
slice is followed at once by a repair round among the survivors on the same segment. A
replica's weight is the number of samples it processed since its last round, at least 1 while it
is active (so an idle stage still averages), and 0 in a sync phase [report 3.3.1.1]. Each round's
outcome goes to the log, to the `{run}/stage/{s}/averaging` record (with the last rounds and
counters), to the self-protection rule (health/round_health.py) and to the divergence watch (divergence.py:
the stage's outlier rejoins through weight sync). In an authenticated run only the stage's credentialed workers
may average with the replica (access.py); the requests and groups it refused are counted. Every part
the replica sends is sealed with its node's key, and a part it refused as a reducer for its norm is
reported to the authorizer as evidence when the round's other parts prove it (evidence.py).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import logging
import queue
import threading
import time
from typing import Awaitable, Callable, Optional

from protocol.auth_state import SharedAuthState
from protocol.dht import SwarmDHT
from protocol.part_evidence import PartEvidence
from protocol.dht_schema import AveragingRecord, Phase, RoundStatus, WorkerRecord, averaging_key, workers_key
from protocol.stats import Distribution
from roles.announcer import Announcer
from roles.periodic import Signal, every
from protocol.run_config import AveragingConfig
from roles.worker.averaging.access import AveragingAccess
from roles.worker.averaging.averager import StageAverager
from roles.worker.averaging.divergence import DivergenceWatch
from roles.worker.averaging.election import Candidate, elect
from roles.worker.averaging.evidence import PartReporter
from roles.worker.health.round_health import RoundHealth
from roles.worker.averaging.index_sets import SegmentIndexSets
from roles.worker.averaging.round_verdicts import RoundVerdicts
from roles.worker.averaging.rounds import RoundOutcome, RoundPlan, SegmentRound
from roles.worker.averaging.schedule import RoundSchedule, segment_of
from roles.worker.averaging.stage_view import CADENCE_SKIP, StageView, skip_reason
from roles.worker.layout import ParameterStore
from roles.worker.health.preemption import PreemptSwitch

logger = logging.getLogger(__name__)

RECENT_ROUNDS = 8


class AveragingState(enum.Enum):
    DISABLED = "disabled"  # averaging is off in the run config
    CREATED = "created"  # the averager process is not started yet
    READY = "ready"  # waiting for the next round
    RUNNING = "running"  # a round is in flight
    STOPPED = "stopped"


class _SerialThread:
    """One daemon thread running blocking jobs in order. Not a ThreadPoolExecutor: its threads are
    joined at interpreter exit, and a round blocked on a dead averager would hold the exit."""

    def __init__(self, name: str):
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while True:
            fn, args, future = self._jobs.get()
            if fn is None:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                    future.set_exception(exc)

    def submit(self, fn, *args) -> asyncio.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        return asyncio.wrap_future(future)

    def close(self) -> None:
        self._jobs.put((None, None, None))


class AveragingService(RoundVerdicts):
    """One replica's averaging: schedules rounds, runs them off the event loop (one at a time),
    publishes their outcomes and decides when the replica must leave its stage."""

    def __init__(self, config: AveragingConfig, *, swarm: SwarmDHT, run_id: str, stage: int,
                 store: ParameterStore, index_sets: SegmentIndexSets, reducer: bool,
                 local_step: Callable[[], int], phase: Callable[[], Phase], samples_processed: Callable[[], int],
                 on_round: Callable[[RoundOutcome], None] = lambda outcome: None,
                 announce_period_s: float = 5.0, stepped: Optional[Signal] = None,
                 auth_state: Optional[SharedAuthState] = None,
                 preempt: Optional[PreemptSwitch] = None, on_divergent: Callable[[str], None] = lambda reason: None,
                 sign: Optional[Callable[[bytes], bytes]] = None,
                 report_evidence: Optional[Callable[[PartEvidence], Awaitable[str]]] = None):
        """`sign`: the node identity's signature, which seals every part this replica sends;
        `report_evidence`: sends a poisoned part's evidence to the run's authorizer and answers the
        verdict (node/daemon.py; None in an open run)."""
        self.config = config
        self.sign = sign
        self.parts_reporter = None if report_evidence is None or sign is None else PartReporter(
            run_id=run_id, max_norm_ratio=config.max_norm_ratio, report=report_evidence)
        self.on_divergent = on_divergent
        """Called when this replica is the stage's outlier (divergence.py): it must resync."""
        self.divergence = DivergenceWatch(config.max_divergence, config.divergence_rounds)
        self.preempt = preempt
        """Shared with the averager process, which dies on it mid-round (roles/worker/health/preemption.py)."""
        self.swarm = swarm
        self.run_id = run_id
        self.stage = stage
        self.store = store
        self.index_sets = index_sets
        self.reducer = reducer
        self.elected = False
        """This replica reduces because the stage elected it (election.py), not by --reducer."""
        self.started_at = time.time()
        """When this replica's averaging began: its stability in the reducer election."""
        self.local_step = local_step
        self.phase = phase
        self.samples_processed = samples_processed
        self.on_round = on_round
        self.access = AveragingAccess(auth_state, stage) if auth_state is not None else None
        """Who may average with us (None in an open run: everyone)."""
        self.state = AveragingState.CREATED if config.enabled else AveragingState.DISABLED
        self.averager: Optional[StageAverager] = None
        self.rounds: Optional[SegmentRound] = None
        self.health = RoundHealth()
        self.gradients_exchanged = False
        """Set by the worker when its stage's replicas add up their gradients every step: the
        averaging rule (exit 3) then only warns."""
        self.leave_reason: Optional[str] = None
        self.left = Signal()
        """Fired once `leave_reason` is set: the worker must leave its stage."""
        self.stepped = stepped
        """The runtime's step signal: a step round can only fall due when it fires."""
        self._counts: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[RoundOutcome] = collections.deque(maxlen=RECENT_ROUNDS)
        self.history: collections.deque[RoundOutcome] = collections.deque(maxlen=128)
        self.announcer = Announcer(swarm, averaging_key(run_id, stage), self.record, period_s=announce_period_s)
        self._current = ("", 0, 0, "")
        self._thread: Optional[_SerialThread] = None
        self._round_task: Optional[asyncio.Task] = None
        self._overran_current = False
        """The running round already doubled the cadence stride."""
        self._chained = False
        """A due round waits for the running one, which was still looking for its group."""
        self.schedule = RoundSchedule(config.average_every, config.idle_period_s)
        self._samples_at_last_round = 0
        self.round_seconds = Distribution()
        """Duration of every round that ran (not the skipped ones)."""
        self.last_completeness: Optional[float] = None
        """The share of the buffer the last round that ran averaged (0 for a failed round)."""
        self.bytes_sent = 0
        self.bytes_received = 0
        """All-reduce payload over every round (RoundOutcome.bytes_sent/received)."""
        self._seconds_moving = 0.0
        """Duration of the rounds that moved bytes: the denominator of `bandwidth`."""

    # ---- lifecycle ----

    def start_averager(self, dht) -> None:
        """Fork the averager process. Call before the node starts threads of its own (docs/architecture.md, 'Processes and threads')."""
        if self.state == AveragingState.DISABLED:
            return
        self.averager = StageAverager(dht, self.index_sets.buffer_size, run_id=self.run_id, stage=self.stage,
                                      reducer=self.reducer, config=self.config, access=self.access,
                                      preempt=self.preempt, sign=self.sign, peer_id=self.swarm.peer_id,
                                      collect_evidence=self.parts_reporter is not None)
        self.averager.start()
        self.rounds = SegmentRound(self.store, self.index_sets, self.averager)
        self._thread = _SerialThread(f"stage{self.stage}-averaging")
        logger.info("averager started (pid %s) as a %s: %d of %d parameters per round (%d segments)",
                    self.averager.pid, "reducer" if self.reducer else "sender", self.index_sets.buffer_size,
                    self.index_sets.numel, self.index_sets.segments)

    def begin(self) -> None:
        """Start counting rounds from the current step (after state loading set it)."""
        self.schedule.begin(self.local_step())
        self.started_at = time.time()
        self._samples_at_last_round = self.samples_processed()
        if self.state == AveragingState.CREATED and self.averager is not None:
            self.state = AveragingState.READY
            self.prefetch(segment_of(self.schedule.last_step_round + 1, self.index_sets.segments))

    async def run(self, stop: asyncio.Event) -> None:
        if self.state == AveragingState.DISABLED:
            return
        announcing = asyncio.create_task(self.announcer.run(stop), name="announce-averaging")
        wake = self.stepped.listen() if self.stepped is not None else None
        try:
            await every(self._next_check_s, self._poll, stop, name="averaging schedule", wake=wake)
        finally:
            announcing.cancel()
            await asyncio.gather(announcing, return_exceptions=True)

    async def shutdown(self) -> None:
        """Withdraw the record and stop the averager process. Idempotent."""
        if self.state in (AveragingState.STOPPED, AveragingState.DISABLED):
            return
        self.state = AveragingState.STOPPED
        await self.announcer.withdraw()
        if self._round_task is not None and not self._round_task.done():
            self._round_task.cancel()
        if self.parts_reporter is not None:
            await self.parts_reporter.close()
        if self.averager is not None:
            await asyncio.to_thread(self.averager.shutdown)
        if self._thread is not None:
            self._thread.close()

    def after_step(self, step: int) -> None:
        """Compute thread, optimizer lock held, `step` steps applied: at a round's boundary, keep
        the segment that round will average as it is now (rounds.py, SegmentRound.capture)."""
        if self.rounds is None or step <= 0 or step % self.config.average_every:
            return
        round_id = step // self.config.average_every
        kept = self.rounds.capture(round_id, segment_of(round_id, self.index_sets.segments))
        self._counts["boundary_snapshots" if kept else "boundary_snapshots_missed"] += 1

    def prefetch(self, segment: int) -> None:
        """Compute a segment's index set in the background (seconds for a 100M-parameter stage)."""
        if self._thread is not None:
            self._thread.submit(self.index_sets.get, segment)

    # ---- scheduling ----

    def _next_check_s(self) -> Optional[float]:
        """When to look at the schedule again if the step does not move: at the next possible
        clock round (idle stages), else only on the step signal."""
        if self.stepped is None:
            return 0.1  # nobody tells us about steps: look often
        if self.state not in (AveragingState.READY, AveragingState.RUNNING) or self.leave_reason:
            return None
        seconds = self.schedule.seconds_to_clock_round()
        return None if seconds is None else max(seconds, 0.01)

    def _poll(self) -> None:
        if self.state not in (AveragingState.READY, AveragingState.RUNNING) or self.leave_reason:
            return
        due = self.schedule.due(self.local_step())
        if due is None:
            return
        kind, round_id = due
        segment = segment_of(round_id, self.index_sets.segments)
        plan = RoundPlan(kind, round_id, segment, 0.0, 0, self.phase().value)
        previous = self._round_task if self._round_task is not None and not self._round_task.done() else None
        if previous is not None and self.rounds is not None and self.rounds.in_allreduce:
            self._skip_overran(plan)
            return
        if not self.schedule.runs(round_id):
            self._finish(RoundOutcome(plan, "", RoundStatus.SKIPPED, failure_reason=self.schedule.cadence()),
                         quiet=True)
            return
        due_at = time.time()
        if previous is not None:
            # The previous round is still looking for its group, maybe one nobody else is in (it
            # read a stride a moment before its peer changed it). Skipping this round as overran
            # would leave the replica a round behind its peers for good, each running the round
            # the other skips, alone. So this round waits for the previous one to end, and runs
            # late if the others are still assembling then (StageAverager.latest_start_s), unless
            # the previous round found its group after all.
            if self._chained:
                self._finish(RoundOutcome(plan, "", RoundStatus.SKIPPED,
                                          failure_reason="the previous round is still looking for its group, and "
                                                         "the round due before this one waits for it"))
                return
            self._chained = True
        else:
            self._overran_current = False
        self._round_task = asyncio.create_task(self._run_round(kind, round_id, due_at, after=previous),
                                               name=f"averaging-{kind}-{round_id}")

    def _skip_overran(self, plan: RoundPlan) -> None:
        """A round fell due while the previous one ran its all-reduce. Replicas that skip
        different rounds would fall out of step: run every other round from now on (schedule.py),
        which all replicas in this situation agree on. One long round doubles the stride once,
        however many rounds fall due while it runs."""
        if not self._overran_current:
            self._overran_current = True
            self.schedule.overran()
        self._counts["rounds_overran"] += 1
        self._finish(RoundOutcome(plan, "", RoundStatus.SKIPPED,
                                  failure_reason=f"the previous round is still running: rounds take longer "
                                                 f"than average_every steps here, so from now on the stage "
                                                 f"averages every {self.schedule.stride}th round"))

    # ---- one round ----

    async def _run_round(self, kind: str, round_id: int, due_at: Optional[float] = None,
                         after: Optional[asyncio.Task] = None) -> bool:
        """One due round (and its repair); `due_at`: when it fell due (unix time). `after`: the
        round still running when this one fell due, which must end first. Returns whether the
        round's all-reduce began."""
        assert self.rounds is not None and self._thread is not None
        if after is not None:
            try:
                await asyncio.wait({after})
            except asyncio.CancelledError:
                after.cancel()
                raise
            finally:
                self._chained = False
            plan = RoundPlan(kind, round_id, segment_of(round_id, self.index_sets.segments), 0.0, 0,
                             self.phase().value)
            if not after.cancelled() and after.exception() is None and after.result():
                self._skip_overran(plan)
                return False
            self._overran_current = False
            late = time.time() - (due_at or time.time())
            if self.averager is not None and late > self.averager.latest_start_s():
                # The others have assembled without this replica by now: running the round alone
                # would only push the next one, which it can still meet on time, late as well.
                self._finish(RoundOutcome(plan, "", RoundStatus.SKIPPED,
                                          failure_reason=f"the previous round looked for its group until {late:.1f}s "
                                                         f"after this one fell due, too late to meet the others"))
                return False
        began = False
        self.state = AveragingState.RUNNING
        try:
            segment = segment_of(round_id, self.index_sets.segments)
            phase = self.phase()
            view = await self._stage_view(phase, round_id if kind in ("step", "clock") else None)
            self._resolve_health(view)
            self._judge_divergence(view, phase)
            if self.leave_reason:
                return
            index_set = await self._thread.submit(self.index_sets.get, segment)
            samples_now = self.samples_processed()
            weight = 0.0 if phase != Phase.ACTIVE else float(max(1, samples_now - self._samples_at_last_round))
            plan = RoundPlan(kind, round_id, segment, weight, view.running, phase.value, due_at)
            self._current = (kind, round_id, segment, index_set.digest)
            self.announcer.poke()
            await self._elect_reducers(view)
            skip = self._skip_reason(view)
            if skip:
                outcome = RoundOutcome(plan, index_set.digest, RoundStatus.SKIPPED, failure_reason=skip)
            else:
                outcome = await self._thread.submit(self.rounds.run, plan)
                began = outcome.allreduce_began
                self._samples_at_last_round = samples_now
                await self._check_index_sets(outcome)
            self._finish(outcome, quiet=skip.endswith(CADENCE_SKIP))
            repair = self._repair_plan(outcome)
            if repair is not None:
                self._finish(await self._thread.submit(self.rounds.run, repair))
            self.prefetch(segment_of(round_id + self.schedule.stride, self.index_sets.segments))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("averaging round %s %d crashed", kind, round_id)
            self._counts["rounds_crashed"] += 1
        finally:
            if self.state == AveragingState.RUNNING:
                self.state = AveragingState.READY
        return began

    async def _stage_view(self, phase: Phase, round_id: Optional[int] = None) -> StageView:
        """The stage before a round; with `round_id`, also which workers skip that round at
        the stride they published (a worker without a record yet counts as running it)."""
        me = self.swarm.peer_id
        workers, records = await asyncio.gather(
            self.swarm.get(workers_key(self.run_id, self.stage), WorkerRecord),
            self.swarm.get(averaging_key(self.run_id, self.stage), AveragingRecord),
        )
        live = {peer: record for peer, record in workers.items() if record.phase != Phase.LEAVING}
        live_ids = set(live) | {me}
        reducers = {peer for peer, record in records.items() if record.reducer and peer in live_ids and peer != me}
        if self.reducer:
            reducers.add(me)
        active = {peer for peer, record in live.items() if record.phase == Phase.ACTIVE and peer != me}
        if phase == Phase.ACTIVE:
            active.add(me)
        records.pop(me, None)
        off_cadence = set() if round_id is None else {
            peer for peer, record in records.items() if peer in live_ids and round_id % record.stride != 0}
        candidates = [Candidate(peer, record.started_at, record.bandwidth) for peer, record in records.items()
                      if peer in active and record.can_reduce and record.phase == Phase.ACTIVE]
        if phase == Phase.ACTIVE and self.averager is not None:
            candidates.append(Candidate(me, self.started_at, self.bandwidth))
        return StageView(expected=len(live_ids), reducers=reducers, active=active, records=records,
                         candidates=candidates, off_cadence=off_cadence)

    def _skip_reason(self, view: StageView) -> str:
        return skip_reason(view, self.config.min_reducers)

    def _repair_plan(self, outcome: RoundOutcome) -> Optional[RoundPlan]:
        """After a round in which a reducer died: hivemind left its slice at local values on every
        survivor, so the survivors average the segment again, among themselves, under the key
        `repair/<round>`. A survivor counts as one if it is alive by what this replica saw: not a
        reducer whose slice failed here, unless its own part still reached this replica whole. The slices that were averaged are equal
        on every survivor but for the steps taken since, so averaging them again is harmless; the
        lost one is averaged after all. None when there is nothing to repair."""
        plan = outcome.plan
        if (not self.config.repair_lost_slices or plan.kind == "repair" or outcome.status != RoundStatus.PARTIAL
                or not outcome.failed_slices):
            return None
        # A reducer whose slice did not come back here but whose own part reached this replica
        # is alive and was in the round: its slice timed out while it waited out the dead one.
        lost = {failed.reducer for failed in outcome.failed_slices} - set(outcome.delivered_senders)
        survivors = [peer for peer in outcome.group if peer not in lost]
        if len(survivors) < 2 or self.swarm.peer_id not in survivors:
            return None
        failed = {failed.reducer for failed in outcome.failed_slices}
        logger.info("%s round %d lost the slice(s) of reducer(s) %s: repairing it with the %d survivors", plan.kind,
                    plan.round, ", ".join(sorted(peer[-6:] for peer in failed)), len(survivors))
        self._counts["rounds_repaired"] += 1
        return RoundPlan("repair", plan.round, plan.segment, plan.weight, len(survivors), plan.phase)

    async def _elect_reducers(self, view: StageView) -> None:
        """Give a stage short of reducers its elected ones before the round (election.py): every
        replica counts them as reducers, and an elected sender promotes itself."""
        wanted = self.config.min_reducers
        if wanted <= 0 or view.expected <= 1:
            return
        elected = elect(view.reducers, view.candidates, wanted)
        if not elected:
            return
        me = self.swarm.peer_id
        view.reducers.update(elected)
        if me not in elected or self.reducer:
            return
        assert self.averager is not None and self._thread is not None
        had = len(view.reducers) - len(elected)
        try:
            await self._thread.submit(self.averager.promote)
        except Exception as exc:  # noqa: BLE001 - the round is skipped, the next one elects again
            view.reducers.discard(me)
            logger.error("stage %d elected this worker to reduce, but it could not switch: %s", self.stage, exc)
            return
        self.reducer = self.elected = True
        self._counts["reducer_promotions"] += 1
        logger.warning("stage %d had %d reducer(s), fewer than averaging.min_reducers %d: this worker was elected "
                       "(the most stable active one: averaging since %s, %.1f MB/s measured) and reduces from now on; "
                       "start stable workers with --reducer to choose them yourself", self.stage, had, wanted,
                       time.strftime("%H:%M:%S", time.localtime(self.started_at)), self.bandwidth / 1e6)
        self.announcer.poke()

    @property
    def bandwidth(self) -> float:
        """All-reduce bytes per second over this replica's rounds so far (0 before any moved bytes)."""
        if self._seconds_moving <= 0:
            return 0.0
        return (self.bytes_sent + self.bytes_received) / self._seconds_moving

    # ---- reporting ----

    def _report_parts(self, found: list[dict]) -> None:
        """Hand a round's evidence of poisoned parts to the reporter (event loop; it reports in
        the background and never raises)."""
        if self.parts_reporter is not None:
            self.parts_reporter.submit_wire(found)

    def refusals(self) -> dict[str, int]:
        """Averaging requests and groups the averager process refused, by reason (access.py)."""
        return self.access.refusals() if self.access is not None else {}

    @property
    def counters(self) -> collections.Counter[str]:
        """Round counters, and the refusals as `averaging_refused_<reason>` (for `agora/v1/info`)."""
        counters = collections.Counter(self._counts)
        counters.update({f"averaging_refused_{reason}": n for reason, n in self.refusals().items()})
        return counters

    def record(self) -> AveragingRecord:
        kind, round_id, segment, digest = self._current
        return AveragingRecord(
            reducer=self.reducer, elected=self.elected, can_reduce=self.averager is not None,
            started_at=self.started_at, bandwidth=self.bandwidth, stride=self.schedule.stride, phase=self.phase(),
            round_kind=kind, round=round_id, segment=segment, digest=digest,
            rounds_complete=self._counts["rounds_complete"], rounds_partial=self._counts["rounds_partial"],
            rounds_failed=self._counts["rounds_failed"], rounds_skipped=self._counts["rounds_skipped"],
            recent=[outcome.to_record() for outcome in self.recent],
        )

    def summary(self) -> dict:
        """Counters, refusals and the last (up to 128) rounds, for the node's exit summary."""
        return {
            "state": self.state.value,
            "reducer": self.reducer,
            "elected": self.elected,
            "counters": dict(self.counters),
            "refused": self.refusals(),
            "evidence": {} if self.parts_reporter is None else dict(self.parts_reporter.counts),
            "rounds": [{**outcome.to_record().model_dump(mode="json"), "rejected_senders": outcome.rejected_senders}
                       for outcome in self.history],
        }
