"""The averager process over a fixed-size round buffer, and the worker's handle on it.

hivemind's `DecentralizedAverager` fixes its tensors' shapes when it is built, so
the stage averages one buffer of `ceil(numel / segments)` float32 values, which each round fills
from that round's index set. It runs in a forked process and must be started before the node
starts threads of its own (docs/architecture.md, 'Processes and threads').

`SpartaAverager` changes three things in the child process and nothing else (the hooks it
uses are protocol/hivemind_adapter.py's, the one place that touches hivemind's private API):
- the all-reduce runs through `InstrumentedRunner`, and a step returns what it saw;
- the group key's bits are set per round from the index-set digest, so replicas whose index sets
  differ never meet (hivemind's schema hash only checks shapes);
- the target group size follows the stage's workers seen in the DHT, so a group assembles as
  soon as everyone is in instead of at the end of the matchmaking window.
Reducers (`--reducer`) run in hivemind's node mode; contributors in client mode only send
[report 3.3.1.8].
"""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import Any, Iterator, Optional

import torch
from hivemind.utils import MPFuture

from protocol.hivemind_adapter import AdaptedAverager
from protocol.run_config import AveragingConfig
from roles.worker.averaging.allreduce import InstrumentedRunner
from roles.worker.errors import AveragingError

logger = logging.getLogger(__name__)


class SpartaAverager(AdaptedAverager):
    """The averager process: rounds run through `InstrumentedRunner` and report what they saw
    (see module docstring)."""

    def __init__(self, buffer: torch.Tensor, dht, *, stall_s: float = 0.0, **kwargs):
        self.stall_s = stall_s
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
        return InstrumentedRunner(stall_s=self.stall_s, label=label, **runner_kwargs)

    def round_result(self, gathered: dict[str, Any], runner: InstrumentedRunner) -> dict[str, Any]:
        return {"gathered": gathered, "telemetry": runner.telemetry()}


def averaging_prefix(run_id: str, stage: int) -> str:
    """The averager's DHT prefix; hivemind forbids dots in it, run ids may contain them."""
    return f"agora_{run_id.replace('.', '_')}_stage{stage}_sparta"


class StageAverager:
    """The worker's handle on its averager process: the shared round buffer, per-round group key
    and size, one step at a time, and shutdown."""

    def __init__(self, dht, buffer_size: int, *, run_id: str, stage: int, reducer: bool,
                 config: AveragingConfig, stall_s: float = 0.0):
        self.config = config
        self.reducer = reducer
        self.buffer = torch.zeros(max(1, buffer_size), dtype=torch.float32)
        self.process = SpartaAverager(
            self.buffer, dht,
            stall_s=stall_s,
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

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid

    def start(self, timeout_s: float = 60.0) -> None:
        """Fork the averager process and wait until it serves. Not `run_in_background`: that
        sets SIGINT to SIG_IGN in the calling process, which would make the node deaf to Ctrl-C."""
        self.process.start()
        try:
            self.process.wait_until_ready(timeout_s)
        except Exception as exc:
            raise AveragingError(f"the averager process did not start within {timeout_s:.0f}s: {exc}") from exc

    def matchmaking_deadline_s(self) -> float:
        """How long a step looks for a group: the window (leaders assemble at its end), plus
        time for the followers' last requests. Kept short on purpose: a replica that found
        nobody must be free again before the next round is due, or it falls out of step with
        its peers for good (each would keep skipping the round the other runs)."""
        return self.config.matchmaking_time_s + max(self.config.request_timeout_s, self.config.matchmaking_time_s / 2)

    def step_timeout_s(self) -> float:
        """Longest a step may take: matchmaking, then the all-reduce."""
        return self.matchmaking_deadline_s() + self.config.allreduce_timeout_s

    def prepare_round(self, group_bits: str, target_group_size: Optional[int]) -> MPFuture:
        """Set the next round's group key bits and the group size at which a leader starts.
        Returns the confirmation without waiting for it: the averager handles its pipe in order,
        so a step sent after this runs with the new key; check the future after sending it."""
        if not all(bit in "01" for bit in group_bits):
            raise AveragingError(f"group bits must be 0s and 1s, got {group_bits!r}")
        return self.process.set_round_group(group_bits, target_group_size)

    def begin_step(self, weight: float, gather: dict[str, Any]):
        """Start matchmaking for one round and return its control; the all-reduce waits for
        `finish_step`, so the caller fills the buffer while the group forms."""
        return self.process.step(weight=float(weight), gather=gather, timeout=self.matchmaking_deadline_s(),
                                 allow_retries=False, require_trigger=True, wait=False)

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

    def shutdown(self) -> None:
        if self.process.is_alive():
            self.process.shutdown()
