"""A worker's self-termination rules [report 3.3.1.6]: the table of rules, and the evaluator that
watches the worker's own events and readings and decides when one fires.

The report's worker runs a log monitor; ours listens to the events themselves (a batch's
exception, a step's verdict, an averaging round's health, a probe's answer, a memory reading)
rather than to regular expressions over its log, so a reworded log line cannot switch a rule off.
Enforcement stays local: no central component has to notice a failing worker or force it out,
which matters when the run owner has no access to a contributor's machine. A worker that leaves
withdraws its records and hands its queued work back (WorkerRole.shutdown) and may rejoin through
admission and the sync phases.

`RULES` is the one table of names, exit codes and sentences: the daemon's exit line, the
worker's summary and the rules table in docs/operations.md (scripts/sync_docs.py) are all read
from it; `protocol/exit_codes.py` holds the codes and tests/unit/test_self_termination.py checks
the two agree.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from protocol.exit_codes import ExitCode
from protocol.run_config import TerminationConfig
from roles.periodic import Signal
from roles.worker.health.round_health import RoundHealth
from roles.worker.errors import SelfTerminated


@dataclass(frozen=True)
class Rule:
    name: str
    """Snake-case name: the run config key `termination.<name>` and the summary's `rule`."""
    exit_code: ExitCode
    immediate: bool
    """Fires on its first cause (True) or once a reading passes a threshold (False)."""
    sentence: str
    """What the node says when the rule fires."""
    cause: str
    """What the rule watches, for the documentation."""


RULES: tuple[Rule, ...] = (
    Rule("device_fault", ExitCode.DEVICE_FAULT, True,
         "the worker's device failed (a CUDA/device error in its compute); it leaves its stage and may rejoin "
         "once the device is healthy",
         "a batch or the compute thread raised an error naming CUDA, cuDNN, cuBLAS, NCCL, a device-side "
         "assert or device out-of-memory; other errors stay bugs (exit 1)"),
    Rule("non_finite", ExitCode.NON_FINITE_GRADIENTS, True,
         "the worker's gradients were non-finite again after the step's retry; it leaves its stage so it "
         "cannot corrupt it",
         "`max_consecutive` steps in a row had a non-finite gradient norm (the first is dropped, the next "
         "step is its retry); a finite step resets the count"),
    Rule("connectivity", ExitCode.LOST_CONNECTIVITY, True,
         "the worker lost peer-to-peer connectivity: no peer answered it; it leaves its stage",
         "once a peer had answered, no trainer request arrived and no probed worker answered "
         "`agora/v1/info` for `after_s` seconds"),
    Rule("progress", ExitCode.PROGRESS_UNREADABLE, True,
         "the worker could not read its stage's global progress from the DHT; it leaves its stage",
         "every read of the stage's progress records failed or timed out for `after_s` seconds"),
    Rule("host_memory", ExitCode.HOST_MEMORY, False,
         "the worker's host RAM use passed the run's limit; it leaves its stage before the host degrades",
         "the process's resident memory (RSS) above `max_bytes` or `max_fraction` of the host's (or "
         "cgroup's) memory"),
    Rule("device_memory", ExitCode.DEVICE_MEMORY, False,
         "the worker's device memory use passed the run's limit; it leaves its stage before the device fails",
         "memory torch holds on the device above `max_bytes` or `max_fraction` of the device's"),
    Rule("averaging", ExitCode.LEFT_STAGE, False,
         "the worker failed too many of its recent averaging rounds while its stage averaged without it; it "
         "leaves its stage, since a replica that keeps missing rounds drifts from the stage",
         "`max_failures` failed rounds among the last `window`, counting only rounds the stage completed "
         "without it (roles/worker/health/round_health.py); a successful round resets the count"),
)
RULES_BY_NAME: dict[str, Rule] = {rule.name: rule for rule in RULES}

_DEVICE_WORDS = re.compile(r"cuda|cudnn|cublas|nccl|device-side|\bhip\b|accelerator", re.IGNORECASE)


def is_device_fault(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is the device failing rather than our code: torch's
    out-of-memory error, or an error whose type or text names CUDA, cuDNN, cuBLAS, NCCL or a
    device-side assert. A host MemoryError or a plain bug is not one."""
    import torch

    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    seen = 0
    while exc is not None and seen < 8:
        if oom is not None and isinstance(exc, oom):
            return True
        if not isinstance(exc, MemoryError) and (_DEVICE_WORDS.search(type(exc).__name__)
                                                 or _DEVICE_WORDS.search(str(exc))):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


@dataclass(frozen=True)
class Firing:
    rule: Rule
    detail: str

    def error(self) -> SelfTerminated:
        return SelfTerminated(self.rule.name, int(self.rule.exit_code),
                              f"self-termination rule {self.rule.name}: {self.rule.sentence} ({self.detail})")

    def summary(self) -> dict:
        return {"rule": self.rule.name, "exit_code": int(self.rule.exit_code), "detail": self.detail}


class _Silence:
    """Time since the last success of something that keeps being tried (a probe, a DHT read).
    Armed by the first success: a worker that never reached anyone has lost nothing."""

    def __init__(self) -> None:
        self.last_ok: Optional[float] = None
        self.failed_since_ok: Optional[str] = None
        """The last failure after `last_ok`, if any."""

    def record(self, ok: bool, detail: str, now: float) -> None:
        if ok:
            self.last_ok, self.failed_since_ok = now, None
        elif self.last_ok is not None:
            self.failed_since_ok = detail or "failed"

    def silent_for(self, now: float) -> Optional[float]:
        """Seconds since the last success, if something failed since then."""
        if self.last_ok is None or self.failed_since_ok is None:
            return None
        return now - self.last_ok


def _over(used: Optional[int], total: Optional[int], rule) -> Optional[str]:
    """Why `used` breaks a MemoryRule's limit, or None."""
    if not rule.enabled or used is None:
        return None
    limits = []
    if rule.max_bytes is not None:
        limits.append((rule.max_bytes, f"max_bytes {_gib(rule.max_bytes)}"))
    if rule.max_fraction is not None and total:
        limits.append((int(rule.max_fraction * total), f"max_fraction {rule.max_fraction:g} of {_gib(total)}"))
    if not limits:
        return None
    limit, named = min(limits)
    return f"{_gib(used)} in use, above the limit {_gib(limit)} ({named})" if used > limit else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


class SelfTermination:
    """Evaluates the rules of a `TerminationConfig` over what the worker reports.

    Events may come from any thread (the compute thread reports batch errors and steps); the
    first rule to fire wins, is kept in `firing`, and fires `fired` so the worker's supervisor
    wakes at once and raises `SelfTerminated` (WorkerRole.run), which the daemon turns into the
    rule's exit code after a clean shutdown.
    """

    def __init__(self, config: TerminationConfig, *, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.fired = Signal()
        self.firing: Optional[Firing] = None
        self._lock = threading.Lock()
        self._non_finite = 0
        self._connectivity = _Silence()
        self._progress = _Silence()

    # ---- firing ----

    def _fire(self, name: str, detail: str) -> Optional[Firing]:
        with self._lock:
            if self.firing is None:
                self.firing = Firing(RULES_BY_NAME[name], detail)
                fired = True
            else:
                fired = False
        if fired:
            self.fired.fire()
        return self.firing

    def raise_if_fired(self) -> None:
        if self.firing is not None:
            raise self.firing.error()

    def summary(self) -> Optional[dict]:
        """`terminated_by` of the worker's summary: the rule that fired, or None."""
        return None if self.firing is None else self.firing.summary()

    # ---- events ----

    def compute_error(self, exc: BaseException) -> bool:
        """A batch or the compute thread raised `exc`; True if that fired device_fault."""
        if not self.config.device_fault.enabled or not is_device_fault(exc):
            return False
        self._fire("device_fault", f"{type(exc).__name__}: {str(exc)[:300]}")
        return True

    def step_result(self, finite: bool, detail: str = "") -> None:
        """A step with samples was taken (`finite`) or its gradients were dropped as non-finite."""
        rule = self.config.non_finite
        if finite:
            self._non_finite = 0
            return
        self._non_finite += 1
        if rule.enabled and self._non_finite >= rule.max_consecutive:
            self._fire("non_finite", f"{self._non_finite} consecutive steps with non-finite gradients; the last: "
                                     f"{detail}")

    def averaging_left(self, reason: str) -> None:
        """The averaging health (round_health.py, configured by `averaging_health`) says leave."""
        if self.config.averaging.enabled:
            self._fire("averaging", reason)

    # ---- samples (the event loop, each check period) ----

    def connectivity(self, ok: bool, detail: str = "", now: Optional[float] = None) -> None:
        self._connectivity.record(ok, detail, self.clock() if now is None else now)

    def progress_read(self, ok: bool, detail: str = "", now: Optional[float] = None) -> None:
        self._progress.record(ok, detail, self.clock() if now is None else now)

    def memory(self, *, host_rss: Optional[int], host_total: Optional[int], device_used: Optional[int] = None,
               device_total: Optional[int] = None) -> None:
        why = _over(host_rss, host_total, self.config.host_memory)
        if why:
            self._fire("host_memory", f"resident memory {why}")
            return
        why = _over(device_used, device_total, self.config.device_memory)
        if why:
            self._fire("device_memory", f"device memory {why}")

    def check(self, now: Optional[float] = None) -> Optional[Firing]:
        """Evaluate the timed rules; returns the firing, if any rule has fired."""
        now = self.clock() if now is None else now
        for name, silence in (("connectivity", self._connectivity), ("progress", self._progress)):
            rule = getattr(self.config, name)
            silent = silence.silent_for(now)
            if rule.enabled and silent is not None and silent >= rule.after_s:
                what = "no peer answered" if name == "connectivity" else "the stage's progress was unreadable"
                self._fire(name, f"{what} for {silent:.0f}s (after_s {rule.after_s:g}); the last failure: "
                                 f"{silence.failed_since_ok}")
        return self.firing


class _NeverLeaves(RoundHealth):
    """RoundHealth with the averaging rule switched off: rounds are still counted, nobody leaves."""

    def should_leave(self) -> Optional[str]:
        return None


def averaging_health(config: TerminationConfig) -> RoundHealth:
    """The averaging service's round health as the run config sets it (averaging rule)."""
    rule = config.averaging
    if not rule.enabled:
        return _NeverLeaves(max_failures=rule.max_failures, window=rule.window)
    return RoundHealth(max_failures=rule.max_failures, window=rule.window)


def rules_table(config: Optional[TerminationConfig] = None) -> str:
    """The rules as a Markdown table, with their run config keys and defaults (docs/operations.md)."""
    config = config or TerminationConfig()
    lines = ["| rule | exit code | kind | fires when | run config (defaults) | the node says |",
             "|---|---|---|---|---|---|"]
    for rule in RULES:
        section = getattr(config, rule.name)
        keys = ", ".join(f"`termination.{rule.name}.{key}: {_yaml(value)}`"
                         for key, value in section.model_dump().items())
        kind = "immediate" if rule.immediate else "thresholded"
        lines.append(f"| `{rule.name}` | {int(rule.exit_code)} | {kind} | {rule.cause} | {keys} | {rule.sentence} |")
    return "\n".join(lines) + "\n"


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)
