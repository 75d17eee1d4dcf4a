"""The averager process over a fixed-size round buffer, and the worker's handle on it.

hivemind's `DecentralizedAverager` fixes its tensors' shapes when it is built, so
the stage averages one buffer of `ceil(numel / segments)` float32 values, which each round fills
from that round's index set. It runs in a forked process and must be started before the node
starts threads of its own (docs/architecture.md, 'Processes and threads').

`SpartaAverager` changes five things in the child process and nothing else (the hooks it
uses are protocol/hivemind_adapter.py's, the one place that touches hivemind's private API):
- the all-reduce runs through `InstrumentedRunner`, which screens the parts it reduces, and a
  step returns what it saw;
- the group key's bits are set per round from the index-set digest, so replicas whose index sets
  differ never meet (hivemind's schema hash only checks shapes);
- the target group size follows the stage's workers seen in the DHT, so a group assembles as
  soon as everyone is in instead of at the end of the matchmaking window;
- in an authenticated run, only credentialed workers of the stage get an answer, and a group
  with anyone else in it is refused (access.py); each round's gathered metadata carries the
  replica's credential for that;
- every part the replica sends is sealed with its node's key, and the gathered metadata says so
  (`PART_SIGNING_KEY`): its reducers refuse its parts without a valid seal, and a refused poisoned
  part of anyone's becomes evidence (protocol/part_evidence.py, evidence.py).
Reducers (`--reducer`) run in hivemind's node mode; contributors in client mode only send
[report 3.3.1.8].
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Any, Callable, Iterator, Optional

import torch
from hivemind.utils import MPFuture, get_dht_time

from protocol.hivemind_adapter import AdaptedAverager
from protocol.part_evidence import PART_SEAL_VERSION, PART_SIGNING_KEY, PartSigning
from protocol.run_config import AveragingConfig
from roles.worker.averaging.access import (
    CREDENTIAL_KEY, GROUP_REFUSED, AveragingAccess, AveragingRefused, Refusal,
)
from roles.worker.averaging.allreduce import InstrumentedRunner
from roles.worker.averaging.screening import PartScreen
from roles.worker.errors import AveragingError
from roles.worker.health.preemption import PreemptSwitch

logger = logging.getLogger(__name__)


class SpartaAverager(AdaptedAverager):
    """The averager process: rounds run through `InstrumentedRunner` and report what they saw
    (see module docstring)."""

    def __init__(self, buffer: torch.Tensor, dht, *, access: Optional[AveragingAccess] = None,
                 screen: Optional[PartScreen] = None, admission_wait_s: float = 5.0,
                 preempt: Optional[PreemptSwitch] = None, signing: Optional[PartSigning] = None,
                 collect_evidence: bool = False, **kwargs):
        self.preempt = preempt
        self.signing = signing
        """Seals this peer's parts and checks its signing senders' (protocol/part_evidence.py)."""
        self.collect_evidence = collect_evidence
        """Whether rounds build evidence of refused parts (an authenticated run: someone to tell)."""
        self.access = access
        self.screen = screen
        self.admission_wait_s = admission_wait_s
        """How long a part from a peer not yet verified waits for our check of its group (it may
        have heard the group's start from the leader before we did)."""
        self._verified_now: Optional[asyncio.Event] = None
        super().__init__([buffer], dht, start=False, **kwargs)

    def run(self) -> None:
        # The child inherits asyncio's signal wake-up fd, which would report its signals to the
        # parent's loop as if the node had received them; and SIGTERM from the reaper must kill it.
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        super().run()

    def make_runner(self, gathered: dict[str, Any], **runner_kwargs) -> InstrumentedRunner:
        own = gathered.get(self.peer_id.to_base58()) or {}
        label = f"{own.get('kind', '?')} round {own.get('round', '?')}"
        round_id = own.get("round") if isinstance(own, dict) else None
        signers = frozenset(peer for peer, data in gathered.items()
                            if isinstance(data, dict) and data.get(PART_SIGNING_KEY) == PART_SEAL_VERSION)
        return InstrumentedRunner(label=label, screen=self.screen, preempt=self.preempt, signing=self.signing,
                                  signers=signers, round_id=round_id if isinstance(round_id, int) else 0,
                                  collect_evidence=self.collect_evidence, **runner_kwargs)

    def round_result(self, gathered: dict[str, Any], runner: InstrumentedRunner) -> dict[str, Any]:
        plain = {peer: {k: v for k, v in data.items() if k != CREDENTIAL_KEY} if isinstance(data, dict) else data
                 for peer, data in gathered.items()}
        return {"gathered": plain, "telemetry": runner.telemetry()}

    # admission (access.py); everyone is admitted in an open run

    async def admit_join(self, peer_id: str, gathered: Any) -> bool:
        return self._verify(peer_id, gathered, "join request")

    async def admit_part(self, peer_id: str) -> bool:
        if self.access is None:
            return True
        deadline = asyncio.get_running_loop().time() + self.admission_wait_s
        while not self.access.is_verified(peer_id):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                self.access.refuse(Refusal.UNVERIFIED, f"all-reduce part from {peer_id}, which is in no group we "
                                                       f"checked")
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._verification_event().wait(), remaining)
        return True

    async def admit_state_request(self, peer_id: str) -> bool:
        if self.access is None or self.access.is_verified(peer_id):
            return True
        self.access.refuse(Refusal.UNVERIFIED, f"state request from {peer_id}, which is in no group we checked")
        return False

    def check_group(self, gathered: dict[str, Any]) -> Optional[str]:
        if self.access is None:
            return None
        me = self.peer_id.to_base58()
        refused = {}
        for peer, metadata in gathered.items():
            if peer == me:
                continue
            try:
                self.access.verify(peer, metadata)
            except AveragingRefused as exc:
                refused[peer] = exc
        if not refused:
            self._verified()
            return None
        members = "; ".join(f"{peer}: {exc}" for peer, exc in refused.items())
        self.access.refuse(Refusal.GROUP, f"a group of {len(gathered)} with {len(refused)} member(s) that are "
                                          f"not workers of stage {self.access.stage} ({members})")
        return (f"{GROUP_REFUSED}: {len(refused)} of its {len(gathered)} members are not credentialed workers of "
                f"stage {self.access.stage} ({', '.join(f'{p[-6:]}: {e.reason.value}' for p, e in refused.items())})")

    def _verify(self, peer_id: str, metadata: Any, what: str) -> bool:
        if self.access is None:
            return True
        try:
            self.access.verify(peer_id, metadata)
        except AveragingRefused as exc:
            self.access.refuse(exc.reason, f"{what} from {peer_id}: {exc}")
            return False
        self._verified()
        return True

    def _verification_event(self) -> asyncio.Event:
        if self._verified_now is None:
            self._verified_now = asyncio.Event()
        return self._verified_now

    def _verified(self) -> None:
        """Wake the parts waiting for a check: each looks again whether its sender is verified now."""
        event, self._verified_now = self._verified_now, None
        if event is not None:
            event.set()


def averaging_prefix(run_id: str, stage: int) -> str:
    """The averager's DHT prefix; hivemind forbids dots in it, run ids may contain them."""
    return f"agora_{run_id.replace('.', '_')}_stage{stage}_sparta"


class StageAverager:
    """The worker's handle on its averager process: the shared round buffer, per-round group key
    and size, one step at a time, and shutdown."""

    def __init__(self, dht, buffer_size: int, *, run_id: str, stage: int, reducer: bool,
                 config: AveragingConfig, access: Optional[AveragingAccess] = None,
                 preempt: Optional[PreemptSwitch] = None, sign: Optional[Callable[[bytes], bytes]] = None,
                 peer_id: str = "", collect_evidence: bool = False):
        """`sign`: the node identity's signature (its libp2p key, `peer_id`), which seals every part
        this replica sends (None: it sends unsealed parts, as an older build did)."""
        self.config = config
        self.reducer = reducer
        self.access = access
        self.signing = None if sign is None else PartSigning(run_id, stage, peer_id, sign)
        self.buffer = torch.zeros(max(1, buffer_size), dtype=torch.float32)
        self._process_kwargs = dict(
            access=access,
            screen=PartScreen(config.max_norm_ratio, config.max_sender_weight),
            preempt=preempt,
            signing=self.signing,
            collect_evidence=collect_evidence and self.signing is not None,
            admission_wait_s=config.sender_timeout_s,
            prefix=averaging_prefix(run_id, stage),
            client_mode=not reducer,
            min_group_size=2,
            target_group_size=None,
            min_matchmaking_time=config.matchmaking_time_s,
            request_timeout=config.request_timeout_s,
            sender_timeout=config.sender_timeout_s,
            reducer_timeout=2 * config.sender_timeout_s,
            next_chunk_timeout=config.sender_timeout_s,
            allreduce_timeout=config.allreduce_timeout_s,
            part_size_bytes=config.part_size_bytes,
            allow_state_sharing=False,
            shutdown_timeout=5,
            daemon=True,
        )
        self._dht = dht
        self.process = self._new_process()

    def _new_process(self) -> "SpartaAverager":
        return SpartaAverager(self.buffer, self._dht, **self._process_kwargs)

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid

    def start(self, timeouts_s: tuple[float, ...] = (20.0, 40.0)) -> None:
        """Fork the averager process and wait until it serves; one that does not serve in time is
        killed and forked again. It starts in about a second; a fork that hangs (seen once in
        CI, under load, in ~50 s with no output) would otherwise keep the worker from ever
        serving. Not `run_in_background`: that sets SIGINT to SIG_IGN in the calling process,
        which would make the node deaf to Ctrl-C."""
        for attempt, timeout_s in enumerate(timeouts_s, 1):
            self.process.start()
            try:
                self.process.wait_until_ready(timeout_s)
                return
            except Exception as exc:  # noqa: BLE001 - a timeout or the child's own error: both end this fork
                failure = f"the averager process did not start within {timeout_s:.0f}s: {exc!r}"
            self._kill()
            if attempt == len(timeouts_s):
                raise AveragingError(f"{failure} (attempt {attempt} of {len(timeouts_s)})")
            logger.warning("%s; forking it again (attempt %d of %d)", failure, attempt + 1, len(timeouts_s))
            self.process = self._new_process()

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)

    def promote(self, timeout_s: float = 10.0) -> bool:
        """Become a reducer from the next round on (the stage elected this sender; election.py).
        Returns whether anything changed."""
        try:
            changed = bool(self.process.promote_to_reducer().result(timeout_s))
        except Exception as exc:
            raise AveragingError(f"the averager process did not switch to reducing: {exc}") from exc
        self.reducer = True
        return changed

    def matchmaking_deadline_s(self) -> float:
        """How long a step looks for a group: the window (leaders assemble at its end), plus
        time for the followers' last requests. Kept short on purpose: a replica that found
        nobody must be free again before the next round is due, or it falls out of step with
        its peers for good (each would keep skipping the round the other runs)."""
        return self.config.matchmaking_time_s + max(self.config.request_timeout_s, self.config.matchmaking_time_s / 2)

    def latest_start_s(self) -> float:
        """How late (after it fell due) a round can still start and meet the replicas that
        started it on time: a follower must reach a leader before the leader's window ends; a
        reducer may also lead, and followers keep looking until their deadline (leader_window_s
        ends its window with theirs), so one request before that."""
        config = self.config
        if self.reducer:
            return self.matchmaking_deadline_s() - config.request_timeout_s
        return max(0.0, config.matchmaking_time_s - config.request_timeout_s)

    def step_timeout_s(self) -> float:
        """Longest a step may take: matchmaking, then the all-reduce."""
        return self.matchmaking_deadline_s() + self.config.allreduce_timeout_s

    def leader_window_s(self, due_at: Optional[float]) -> float:
        """How long the window this replica declares as a group leader lasts, for a round that
        fell due at `due_at` (unix time; None: now). hivemind lets a follower join only a leader
        whose window ends no later than its own, so a reducer that starts a round late (its last
        round ran long, or found nobody) would be refused by every follower that started on time:
        its window ends when theirs does, but lasts at least `request_timeout_s`. A sender never
        leads, and the requests any replica sends as a follower keep the whole window: a late
        follower is welcome."""
        window = self.config.matchmaking_time_s
        if due_at is None or not self.reducer:
            return window
        late = max(0.0, time.time() - due_at)
        return max(min(window, self.config.request_timeout_s), window - late)

    def prepare_round(self, group_bits: str, target_group_size: Optional[int],
                      leader_window_s: Optional[float] = None) -> MPFuture:
        """Set the next round's group key bits, the group size at which a leader starts and the
        window it declares. Returns the confirmation without waiting for it: the averager handles
        its pipe in order, so a step sent after this runs with them; check the future after
        sending it."""
        if not all(bit in "01" for bit in group_bits):
            raise AveragingError(f"group bits must be 0s and 1s, got {group_bits!r}")
        window = self.config.matchmaking_time_s if leader_window_s is None else leader_window_s
        return self.process.set_round_group(group_bits, target_group_size, window)

    def begin_step(self, weight: float, gather: dict[str, Any], leader_window_s: Optional[float] = None):
        """Start matchmaking for one round and return its control; the all-reduce waits for
        `finish_step`, so the caller fills the buffer while the group forms. `leader_window_s`:
        the window `prepare_round` set, when the all-reduce is scheduled. In an authenticated run
        the gathered metadata also carries this node's credential (access.py)."""
        if self.access is not None:
            credential = self.access.credential_bytes()
            if not credential:
                raise AveragingError("this node has no credential to average with (the trust directory lost it)")
            gather = {**gather, CREDENTIAL_KEY: credential}
        if self.signing is not None:
            gather = {**gather, PART_SIGNING_KEY: PART_SEAL_VERSION}
        window = self.config.matchmaking_time_s if leader_window_s is None else leader_window_s
        return self.process.step(weight=float(weight), gather=gather, scheduled_time=get_dht_time() + window,
                                 timeout=self.matchmaking_deadline_s(), allow_retries=False, require_trigger=True,
                                 wait=False)

    def finish_step(self, control) -> dict[str, Any]:
        """Let the all-reduce run on the buffer as it is now; returns `{"gathered", "telemetry"}`.
        Raises whatever hivemind raised (no group, all-reduce broken, timeout)."""
        try:
            control.allow_allreduce()
            result = control.result(self.step_timeout_s() + 10)
        except BaseException:
            control.cancel()
            raise
        if not isinstance(result, dict) or "telemetry" not in result:
            raise AveragingError(f"the averager returned {type(result).__name__}, not a round report")
        return result

    @staticmethod
    def began_allreduce(control) -> bool:
        """Whether a step found its group and started the all-reduce (so far, or before it ended)."""
        return bool(control.began_allreduce)

    def step(self, weight: float, gather: dict[str, Any]) -> dict[str, Any]:
        """One round on the buffer as it is now (begin and finish at once)."""
        return self.finish_step(self.begin_step(weight, gather))

    @contextlib.contextmanager
    def locked_buffer(self, timeout_s: float) -> Iterator[torch.Tensor]:
        """The round buffer, while the averager process cannot touch it (it holds the same lock
        for a whole all-reduce)."""
        with self.process.tensors_locked(timeout_s) as acquired:
            if not acquired:
                raise AveragingError(f"the averager held its buffer for more than {timeout_s:.0f}s; "
                                     "a previous all-reduce is still running")
            yield self.buffer

    def refusals(self) -> dict[str, int]:
        """Averaging requests and groups refused so far, by reason (access.py)."""
        return {} if self.access is None else self.access.refusals()

    def shutdown(self) -> None:
        if self.process.is_alive():
            self.process.shutdown()
