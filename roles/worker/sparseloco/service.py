"""When a SparseLoCo fragment is captured, exchanged and applied, and what is reported.

After stage step t (the compute thread, the optimizer's lock held) every fragment due at t
(chunks.fragment_due) is captured: its pseudo-gradient is folded into the error buffer, compressed,
signed, and handed to the event loop, which exchanges it (transport.py) while training goes on.
After step t + tau (the lock released) the compute thread waits for that exchange if it is still
running (the wait on the critical path, measured), checks every fragment that arrived, and applies
the mean of the good ones with its own (outer.py) under the lock. A worker outside its active phase
neither captures nor applies: a joiner starts at the next cycle, from the anchor it loaded.

A fragment is refused, and its sender named in the log and the counts, when it does not decode or
verify (codec.py), when its sender is not who delivered it, or when its norm is more than
`max_norm_ratio` times away from this replica's own. A replica whose anchor differs from the one the
other replicas agree on has parted from them (it missed a fragment they applied); it says so and
the worker reloads its stage's state.

A fragment refused for its norm alone was signed by its sender: with two good fragments of the
round that agree (this replica's own among them) it is evidence, which the FragmentReporter
(evidence.py) checks and reports to the run's authorizer, off the compute thread, once per sender
and round. The authorizer bans the sender's account if the witnesses are on other accounts.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

import torch

from protocol.dht_schema import AveragingRecord, Phase, RoundStatus, RoundSummaryRecord
from protocol.errors import ErrorCode, ProtocolError
from protocol.fragment_evidence import FragmentEvidence
from protocol.identity import Identity
from protocol.run_config import RunConfig
from protocol.stats import Distribution
from roles.periodic import Signal
from roles.worker.health.round_health import RoundHealth
from roles.worker.layout import FlatLayout
from roles.worker.sparseloco.chunks import Fragment, fragment_due, plan_fragments
from roles.worker.sparseloco.codec import (
    HEADER_BUDGET_BYTES,
    Compressed,
    Envelope,
    decode_fragment,
    decompress,
    encode_fragment,
    expected_payload_bytes,
)
from roles.worker.sparseloco.evidence import FragmentReporter
from roles.worker.sparseloco.outer import Capture, SparseLoCoState, anchor_digest
from roles.worker.sparseloco.transport import Exchanged, FragmentTransport, RoundKey

logger = logging.getLogger(__name__)

RECENT_ROUNDS = 8
LOW_COVERAGE = 3.0
"""Rounds x density under which a run is warned at start (SparseLoCoService.coverage)."""
ANCHOR_KEY = "sparseloco.anchor"
"""The anchor's name among the optimizer's outer tensors (checkpoints, state transfer)."""


@dataclass
class RoundReport:
    """One fragment's round as this replica saw it."""

    round: int
    fragment: int
    status: str  # complete | partial | alone | failed
    expected: int = 0
    """Other replicas this one expected fragments from."""
    anchor: str = ""
    finished_at: float = 0.0
    applied_from: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    refused: dict[str, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_s: float = 0.0
    update_norm: float = 0.0

    def to_summary(self) -> dict:
        return {"round": self.round, "fragment": self.fragment, "status": self.status,
                "applied_from": list(self.applied_from), "missing": list(self.missing),
                "refused": dict(self.refused), "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "wait_s": round(self.wait_s, 3), "update_norm": self.update_norm, "anchor": self.anchor}

    def to_record(self) -> RoundSummaryRecord:
        """As the stage's averaging record carries a round (the dashboard's rounds table)."""
        status = {"alone": RoundStatus.SKIPPED}.get(self.status) or RoundStatus(self.status)
        why = []
        if self.missing:
            why.append(f"no fragment from {len(self.missing)} replica(s)")
        if self.refused:
            why.append(f"refused {len(self.refused)}")
        return RoundSummaryRecord(
            kind="sloco", round=self.round, segment=self.fragment, digest=self.anchor, status=status,
            group_size=len(self.applied_from), expected_group_size=self.expected + 1,
            averaging_success=len(self.applied_from) / (self.expected + 1), duration_s=self.wait_s,
            weight=1.0, failure_reason="; ".join(why)[:512],
            banned_senders=[p for p in sorted(self.refused)][:16], finished_at=self.finished_at)

    def describe(self) -> str:
        peers = len(self.applied_from)
        text = (f"sparseloco round {self.round} fragment {self.fragment}: {self.status}, applied {peers} "
                f"fragment(s), sent {self.bytes_sent} B, received {self.bytes_received} B, waited {self.wait_s:.2f}s")
        if self.missing:
            text += f"; missing {', '.join(p[-8:] for p in self.missing)}"
        if self.refused:
            text += "; refused " + ", ".join(f"{p[-8:]} ({why})" for p, why in sorted(self.refused.items()))
        return text


class SparseLoCoService:
    """One replica's SparseLoCo: its state, its rounds and their counts."""

    def __init__(self, run: RunConfig, stage: int, layout: FlatLayout, optimizer, *, self_id: str,
                 identity: Identity, active: Callable[[], bool],
                 on_parted: Callable[[str], None] = lambda why: None,
                 stopping: Callable[[], bool] = lambda: False, members: Callable[[], list[str]] = lambda: [],
                 report_evidence: Optional[Callable[[FragmentEvidence], Awaitable[str]]] = None):
        self.config = run.averaging.sparseloco
        self.total_steps = run.optimizer.total_steps
        self.run_id = run.run_id
        self.stage = stage
        self.layout = layout
        self.optimizer = optimizer
        self.self_id = self_id
        self.identity = identity
        self.active = active
        self.on_parted = on_parted
        self.stopping = stopping
        self.fragments: list[Fragment] = plan_fragments(layout, chunk_size=self.config.chunk_size,
                                                        topk=self.config.topk_per_chunk,
                                                        fragments=self.config.fragments)
        self.transport: Optional[FragmentTransport] = None
        self.state: Optional[SparseLoCoState] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._inflight: dict[int, tuple[Capture, concurrent.futures.Future, int, bytes]] = {}
        """Per fragment: its capture, its exchange, the step after which it is applied, and this
        replica's own fragment as sent (a witness, should a peer's be refused)."""
        self.counters: collections.Counter[str] = collections.Counter()
        self.refused_by_sender: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[RoundReport] = collections.deque(maxlen=RECENT_ROUNDS)
        self.wait_s = Distribution()
        """Seconds the compute thread waited for an exchange to finish (the critical path), per round."""
        self.wait_total_s = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.parted: Optional[str] = None
        self.members = members
        """The stage's other replicas with a live (signed, in authenticated runs credentialed) progress record."""
        self.known: set[str] = set()
        """Every replica of the stage seen in `members` so far: a fragment from anyone else is refused
        (a store is writable by whoever holds its credentials, not only by the run's workers)."""
        self.health = RoundHealth()
        """The averaging rule's window (the worker sets it from the run config: averaging_health)."""
        self.leave_reason: Optional[str] = None
        self.left = Signal()
        """Fired once `leave_reason` is set: the worker must leave its stage."""
        self.reporter = None if report_evidence is None else FragmentReporter(
            run_id=run.run_id, stage=stage, layout=layout, config=self.config, self_id=self_id, report=report_evidence)
        self._reports: set[concurrent.futures.Future] = set()

    # ---- arithmetic ----

    def max_bytes(self, fragment: int) -> int:
        if not 0 <= fragment < len(self.fragments):
            return 0
        return expected_payload_bytes(self.fragments[fragment], self.config.bits) + HEADER_BUDGET_BYTES

    @property
    def kept(self) -> int:
        return sum(f.kept for f in self.fragments)

    @property
    def density(self) -> float:
        return self.kept / self.layout.numel

    def expected_round_bytes(self) -> int:
        """The method's arithmetic for one whole cycle (all fragments) sent to one peer."""
        return sum(expected_payload_bytes(f, self.config.bits) for f in self.fragments)

    # ---- lifecycle ----

    def begin(self, transport: FragmentTransport) -> None:
        """Start from the weights the worker holds now (after state loading): they are the anchor."""
        self._loop = asyncio.get_running_loop()
        self.transport = transport
        with self.optimizer.lock:
            self.state = SparseLoCoState.starting_at(self._read_all())
            loaded = self.optimizer.loaded_outer.get(ANCHOR_KEY)
            if loaded is not None and loaded.numel() == self.layout.numel:
                self.state.anchor.copy_(loaded.reshape(-1))  # a joiner takes its donor's consensus
            self.optimizer.outer_state = lambda: {ANCHOR_KEY: self.state.anchor}
        logger.info("sparseloco: %d fragment(s) of %d parameters, %d kept per cycle (%.2f%% dense), %d-bit values, "
                    "H %d, tau %d, over the %s; %d bytes to each replica per cycle (dense: %d)",
                    len(self.fragments), self.layout.numel, self.kept, 100 * self.density, self.config.bits,
                    self.config.inner_steps, self.config.overlap_steps, transport.name,
                    self.expected_round_bytes(), 4 * self.layout.numel)
        coverage = self.coverage(self.total_steps)
        if coverage < LOW_COVERAGE:
            logger.warning("sparseloco: over this run's %d steps each coordinate can be sent %.2f times (%d rounds x "
                           "%.2f%% density); below %g most weights barely move and the model trains far worse than "
                           "with AsyncSPARTA (docs/operations.md, 'Keeping a stage's replicas together'): lower "
                           "inner_steps or raise topk_per_chunk", self.total_steps, coverage,
                           self.total_steps // self.config.inner_steps, 100 * self.density, LOW_COVERAGE)

    def coverage(self, total_steps: int) -> float:
        """How many times over a run of `total_steps` the exchange can send each coordinate: its
        rounds times its density. Well below a few, most weights barely move from their start
        (bench_sparseloco.py: +242% held-out at 150 steps, coverage 0.16)."""
        return total_steps / self.config.inner_steps * self.density

    def restart_from_loaded(self) -> None:
        """The worker reloaded its stage's state (it had parted): the loaded weights are the anchor."""
        with self.optimizer.lock:
            for f in list(self._inflight):
                self._inflight.pop(f)[1].cancel()
            if self.state is not None:
                loaded = self.optimizer.loaded_outer.get(ANCHOR_KEY)
                fits = loaded is not None and loaded.numel() == self.layout.numel
                self.state.reset(self._read_all(), loaded.reshape(-1) if fits else None)
        self.parted = None

    def _read_all(self) -> torch.Tensor:
        return self.layout.read(self.optimizer.master_params, 0, self.layout.numel)

    # ---- the compute thread ----

    def after_step(self, step: int) -> None:
        """Lock held: capture the fragments due after `step` and start their exchange."""
        if self.state is None or self._loop is None or not self.active() or self.parted:
            return
        for f in fragment_due(step, self.config.fragments, self.config.inner_steps):
            if f >= len(self.fragments):
                continue
            if f in self._inflight:  # the previous capture of this fragment was never applied
                self.counters["captures_overrun"] += 1
                continue
            frag = self.fragments[f]
            self.known.update(self.members())
            weights = self.layout.read(self.optimizer.master_params, frag.start, frag.numel)
            cap = self.state.capture(step, frag, weights, beta=self.config.error_decay, bits=self.config.bits)
            data = encode_fragment(cap.own, self._envelope(step, f, anchor=cap.anchor), self.identity)
            deadline = time.monotonic() + self.config.round_timeout_s
            future = asyncio.run_coroutine_threadsafe(
                self.transport.exchange(RoundKey(step, f), data, deadline), self._loop)
            self._inflight[f] = (cap, future, step + self.config.overlap_steps, data)
            self.counters["captures"] += 1

    def after_step_unlocked(self, step: int) -> None:
        """Lock free: wait for and apply every fragment whose aggregate is due after `step`."""
        with self.optimizer.lock:  # a reload on the event loop may clear them meanwhile
            due = sorted(((f, cap, future, sent) for f, (cap, future, apply_at, sent) in self._inflight.items()
                          if apply_at <= step), key=lambda entry: entry[0])
        for f, cap, future, sent in due:
            self._finish(f, cap, future, sent)

    def _finish(self, f: int, cap: Capture, future: concurrent.futures.Future, sent: bytes) -> None:
        started = time.monotonic()
        exchanged: Optional[Exchanged] = None
        while exchanged is None:
            try:
                exchanged = future.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                if self.stopping():
                    return  # the worker leaves: nothing is applied, the weights stay as they are
            except Exception as exc:  # noqa: BLE001 - a failed exchange must not kill the compute thread
                logger.warning("sparseloco round %d fragment %d: the exchange failed (%s: %s); applying this "
                               "replica's own fragment alone", cap.round, f, type(exc).__name__, exc)
                exchanged = Exchanged({}, 0, 0, ())
        waited = time.monotonic() - started
        report = self._screen(cap, exchanged)
        report.wait_s = waited
        if report.norm_refused:
            self._report_lies(cap, report, sent)
        with self.optimizer.lock:
            if self.state.pending.get(f) is not cap:
                return  # the replica reloaded its state meanwhile: this round is void
            self._inflight.pop(f, None)
            frag = self.fragments[f]
            # Our own always counts: a push that failed may have failed because its peer died, and
            # the living must agree; a replica whose fragment the others lacked parts and reloads.
            contributions = {self.self_id: cap.own, **report.contributions}
            weights_now = self.layout.read(self.optimizer.master_params, frag.start, frag.numel)
            new_weights, applied = self.state.apply(f, contributions, weights_now, alpha=self.config.outer_lr)
            self.layout.write(self.optimizer.master_params, frag.start, new_weights)
            self.optimizer.push_master_to_device()
        report.applied_from = applied.senders
        report.update_norm = applied.update_norm
        report.anchor = applied.anchor
        report.expected = len(exchanged.expected)
        report.finished_at = time.time()
        del report.contributions, report.wire, report.norm_refused
        self._record(report, waited, parted=report.parted)

    # ---- checking what arrived ----

    def _screen(self, cap: Capture, exchanged: Exchanged) -> "_Screened":
        f = cap.fragment.index
        expected_env = self._envelope(cap.round, f)
        frag = self.fragments[f]
        good: dict[str, Compressed] = {}
        wire: dict[str, tuple[bytes, float]] = {}
        norm_refused: dict[str, tuple[bytes, float]] = {}
        refused: dict[str, str] = {}
        anchors: dict[str, str] = {}
        for sender, data in sorted(exchanged.received.items()):
            try:
                if sender not in self.known:
                    self.known.update(self.members())
                    if sender not in self.known:
                        raise ProtocolError(f"{sender[-8:]} is not a replica of this stage", ErrorCode.UNAUTHENTICATED)
                envelope, compressed = decode_fragment(data, expected_env, frag)
                if envelope.sender != sender:
                    raise ProtocolError(f"signed by {envelope.sender[-8:]}, delivered as {sender[-8:]}",
                                        ErrorCode.UNAUTHENTICATED)
                norm = float(decompress(compressed, frag).norm())
                ratio = self.config.max_norm_ratio
                if cap.own_norm > 0 and not (cap.own_norm / ratio <= norm <= cap.own_norm * ratio):
                    norm_refused[sender] = (data, norm)  # signed by its sender: perhaps evidence
                    raise ProtocolError(f"norm {norm:.3g} against this replica's {cap.own_norm:.3g} "
                                        f"(more than {ratio:g}x apart)", ErrorCode.INVALID_TENSOR)
            except ProtocolError as exc:
                refused[sender] = str(exc)
                self.refused_by_sender[sender] += 1
                self.counters[f"fragments_refused_{exc.code.name.lower()}"] += 1
                logger.warning("sparseloco round %d fragment %d: refused the fragment of %s: %s",
                               cap.round, f, sender, exc)
                continue
            good[sender] = compressed
            wire[sender] = (data, norm)
            anchors[sender] = envelope.anchor
        parted = self._check_anchor(cap, anchors)
        missing = tuple(p for p in exchanged.expected if p not in exchanged.received)
        gone = set(exchanged.unreachable)
        if not good and all(p in gone for p in missing):
            status = "alone"  # nobody expected, or everyone expected is gone (its push failed)
        elif good and not missing and not refused:
            status = "complete"
        elif good:
            status = "partial"
        else:
            status = "failed"
        return _Screened(round=cap.round, fragment=f, status=status, missing=missing, refused=refused,
                         bytes_sent=exchanged.bytes_sent, bytes_received=exchanged.bytes_received,
                         contributions=good, parted=parted, wire=wire, norm_refused=norm_refused)

    def _report_lies(self, cap: Capture, screened: "_Screened", sent: bytes) -> None:
        """Report the fragments refused for their norm to the authorizer, if the round's good
        fragments (this replica's own among them) prove it; in the background, never raising."""
        if self.reporter is None or self._loop is None:
            return
        good = {**screened.wire, self.self_id: (sent, cap.own_norm)}
        try:
            found = self.reporter.evidence(cap.round, cap.fragment.index, screened.norm_refused, good)
            for evidence in found:
                future = asyncio.run_coroutine_threadsafe(self.reporter.send(evidence), self._loop)
                self._reports.add(future)
                future.add_done_callback(self._reports.discard)
        except Exception:  # noqa: BLE001 - a report is a courtesy to the run; the round goes on
            logger.exception("sparseloco round %d fragment %d: could not report the refused fragments",
                             cap.round, cap.fragment.index)

    def _check_anchor(self, cap: Capture, anchors: dict[str, str]) -> bool:
        """Whether this replica parted from its stage: the replicas (this one included) are grouped
        by the anchor they held; the largest group, ties to the group with the smallest peer id,
        is the stage's consensus, chosen alike by every replica that saw the same fragments."""
        groups: dict[str, list[str]] = collections.defaultdict(list)
        for sender, digest in {**anchors, self.self_id: cap.anchor}.items():
            groups[digest].append(sender)
        if len(groups) == 1:
            return False
        top = min(groups, key=lambda d: (-len(groups[d]), min(groups[d])))
        if top == cap.anchor:
            return False
        self.counters["anchor_mismatches"] += 1
        if self.parted is None:
            self.parted = (f"round {cap.round} fragment {cap.fragment.index}: {len(groups[top])} replica(s) hold "
                           f"anchor {top}, this replica {cap.anchor}")
            logger.warning("sparseloco: this replica parted from its stage (%s); reloading its state", self.parted)
            self.on_parted(self.parted)
        return True

    def _record(self, report: RoundReport, waited: float, parted: bool) -> None:
        self.counters[f"rounds_{report.status}"] += 1
        # The averaging rule [report 3.3.1.6]: a round in which this replica found it had parted
        # from the stage (the others exchanged without it) is a failure; a failed round alone is
        # not (the others may have failed it too); every other round resets the count.
        if parted:
            self.health.record_failure("sparseloco", report.round)
            self.health.resolve([("sparseloco", report.round)])
            why = self.health.should_leave()
            if why and self.leave_reason is None:
                self.leave_reason = why.replace("averaging rounds", "SparseLoCo rounds")
                self.left.fire()
        elif report.status != "failed":
            self.health.record_success()
        self.bytes_sent += report.bytes_sent
        self.bytes_received += report.bytes_received
        self.wait_s.observe(waited)
        self.wait_total_s += waited
        self.recent.append(report)
        log = logger.info if report.status in ("complete", "alone") else logger.warning
        log("%s", report.describe())

    def _envelope(self, round_id: int, fragment: int, anchor: str = "") -> Envelope:
        c = self.config
        return Envelope(self.run_id, self.stage, round_id, fragment, self.layout.digest, c.chunk_size,
                        c.topk_per_chunk, c.bits, sender=self.self_id, anchor=anchor)

    # ---- reporting ----

    def record(self, phase: Phase) -> AveragingRecord:
        """What the stage's averaging record says of this replica (`{run}/stage/{s}/averaging`)."""
        c = self.counters
        last = self.recent[-1] if self.recent else None
        return AveragingRecord(
            phase=phase, round_kind="sloco", round=last.round if last else 0, segment=last.fragment if last else 0,
            digest=last.anchor if last else "", rounds_complete=c["rounds_complete"],
            rounds_partial=c["rounds_partial"], rounds_failed=c["rounds_failed"], rounds_skipped=c["rounds_alone"],
            recent=[r.to_record() for r in self.recent], method="sparseloco", density=min(1.0, self.density),
            bytes_per_round=last.bytes_sent // max(1, last.expected) if last else None,
            wait_s=round(self.wait_total_s, 3))

    def anchor_digests(self) -> list[str]:
        """Per fragment, the digest of this replica's consensus anchor now: equal replicas, equal lists."""
        if self.state is None:
            return []
        with self.optimizer.lock:
            return [anchor_digest(self.state.anchor[f.start:f.end]) for f in self.fragments]

    def summary(self) -> dict:
        rounds = {k[len("rounds_"):]: v for k, v in self.counters.items() if k.startswith("rounds_")}
        return {
            "method": "sparseloco",
            "transport": None if self.transport is None else self.transport.name,
            "fragments": len(self.fragments),
            "density": round(self.density, 5),
            "bits": self.config.bits,
            "expected_bytes_per_cycle": self.expected_round_bytes(),
            "dense_bytes_per_cycle": 4 * self.layout.numel,
            "rounds": rounds,
            "captures": self.counters["captures"],
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "wait_s": round(self.wait_total_s, 3),
            "refused": {k: v for k, v in self.counters.items() if k.startswith("fragments_refused_")},
            "refused_senders": dict(self.refused_by_sender),
            "anchor_mismatches": self.counters["anchor_mismatches"],
            "evidence": {} if self.reporter is None else dict(self.reporter.counts),
            "anchors": self.anchor_digests(),
            "recent": [r.to_summary() for r in self.recent],
        }


@dataclass
class _Screened(RoundReport):
    contributions: dict[str, Compressed] = field(default_factory=dict)
    parted: bool = False
    wire: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    """The good fragments as they arrived, and their norms."""
    norm_refused: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    """The fragments refused for their norm alone (they decoded and verified), and their norms."""
