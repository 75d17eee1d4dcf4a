"""The averager process over a fixed-size round buffer, and the worker's handle on it.

hivemind's `DecentralizedAverager` (DESIGN §3) fixes its tensors' shapes when it is built, so
the stage averages one buffer of `ceil(numel / segments)` float32 values, which each round fills
from that round's index set. It runs in a forked process and must be started before the node
starts threads of its own (DESIGN §10).

`SpartaAverager` changes three things in the child process and nothing else:
- the all-reduce runs through `InstrumentedRunner`, and a step returns what it saw;
- the group key's bits are set per round from the index-set digest, so replicas whose index sets
  differ never meet (hivemind's schema hash only checks shapes);
- the target group size follows the stage's workers seen in the DHT, so a group assembles as
  soon as everyone is in instead of at the end of the matchmaking window.
Reducers (`--reducer`) run in hivemind's node mode; contributors in client mode only send
[report 3.3.1.8].
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any, Iterator, Optional

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import enter_asynchronously

from roles.model.config import AveragingConfig
from roles.worker.averaging.allreduce import InstrumentedRunner
from roles.worker.errors import AveragingError

logger = logging.getLogger(__name__)


class SpartaAverager(DecentralizedAverager):
    """DecentralizedAverager whose rounds report what they saw (see module docstring)."""

    def __init__(self, buffer: torch.Tensor, dht, *, stall_s: float = 0.0, **kwargs):
        self._stall_s = stall_s
        super().__init__([buffer], dht, start=False, **kwargs)

    def run(self) -> None:
        # The child inherits asyncio's signal wake-up fd, which would report its signals to the
        # parent's loop as if the node had received them; and SIGTERM from the reaper must kill it.
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        super().run()

    async def _prepare_round(self, group_bits: str, size: Optional[int], future: MPFuture) -> None:
        """Per round, in the averager process: the group key's bits, and the group size at which
        a leader starts the all-reduce without waiting for the end of the window."""
        try:
            self._matchmaking.group_key_manager.group_bits = group_bits
            self._matchmaking.target_group_size = size
            self._matchmaking.potential_leaders.target_group_size = size
            future.set_result(None)
        except Exception as exc:  # noqa: BLE001 - reported to the host process
            future.set_exception(exc)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs) -> Any:
        """hivemind's version, but the runner is instrumented and its telemetry is returned."""
        try:
            bandwidths, mode_ids, user_gathered_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            user_gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_gathered_bytes)))
            modes = [AveragingMode(mode) for mode in mode_ids]
            download_bandwidths = [thr if mode != AveragingMode.CLIENT else 0.0 for thr, mode in zip(bandwidths, modes)]
            peer_fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, self.total_size, download_bandwidths, min_vector_size
            )
            own = user_gathered.get(self.peer_id) or {}
            label = f"{own.get('kind', '?')} round {own.get('round', '?')}"
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                runner = await self._run_instrumented(local_tensors, group_info, label, peer_fractions=peer_fractions,
                                                      **kwargs)
            return {
                "gathered": {peer.to_base58(): data for peer, data in user_gathered.items()},
                "telemetry": runner.telemetry(),
            }
        except BaseException as exc:
            if isinstance(exc, Exception):
                logger.debug("all-reduce failed", exc_info=True)
            raise MatchmakingException(f"Unable to run All-Reduce: {exc}") from exc

    async def _run_instrumented(self, tensors, group_info, label: str, **kwargs) -> InstrumentedRunner:
        runner = InstrumentedRunner(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
            group_id=group_info.group_id, ordered_peer_ids=group_info.peer_ids,
            stall_s=self._stall_s, label=label, **kwargs,
        )
        self._running_groups[group_info.group_id].set_result(runner)
        async for tensor, update in _zip_updates(tensors, runner):
            tensor.add_(update, alpha=self._averaging_alpha)
        return runner


async def _zip_updates(tensors, runner):
    index = 0
    async for update in runner:
        yield tensors[index], update
        index += 1


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
        future = MPFuture()
        self.process._outer_pipe.send(("_prepare_round", [], dict(group_bits=group_bits, size=target_group_size,
                                                                   future=future)))
        return future

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
        lock = self.process.lock_averaged_tensors
        if not lock.acquire(timeout=timeout_s):
            raise AveragingError(f"the averager held its buffer for more than {timeout_s:.0f}s; "
                                 "a previous all-reduce is still running")
        try:
            yield self.buffer
        finally:
            lock.release()

    def shutdown(self) -> None:
        if self.process.is_alive():
            self.process.shutdown()
