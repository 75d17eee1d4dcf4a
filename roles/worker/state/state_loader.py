"""Load a stage's parameters from live replicas over `agora/v1/state` [report 3.3.1.1]: the
fallback when no replica serves the multi-donor download (donor_client.py) or it failed.

The transfer is a sequence of chunk requests over one pooled libp2p stream per peer, so it can
resume: a chunk that stalls past `chunk_timeout_s` (or a peer that fails) does not restart the
download, the next request asks the next peer for the first element still missing. A peer whose
layout differs is dropped at once; one that fails twice is dropped too. Chunks are written into
the master weights as they arrive (a staging copy would double the stage's memory); if no peer
can finish, the caller falls back to a checkpoint or to weight sync from where this got.

Progress goes to stderr: a rich bar with bytes and rate on a terminal, otherwise a log line after
the first chunk and then every `PROGRESS_LOG_PERIOD_S` (a bar that is redrawn in place means nothing
in a log file). Every resume is logged.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from hivemind.p2p import P2P, PeerID
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from protocol import version
from protocol.errors import AgoraError
from protocol.state_messages import StateReply, StateRequest
from protocol.transport import RpcClient, dial
from roles.worker.errors import StateLoadError
from roles.worker.layout import FlatLayout, ParameterStore

logger = logging.getLogger(__name__)

PROGRESS_LOG_PERIOD_S = 5.0
"""Without a terminal: how often the download's progress is logged after its first chunk."""


@dataclass
class LoadResult:
    step: int
    """The oldest server step among the chunks (what the joiner's staleness is measured from)."""
    elements: int
    seconds: float
    peers: list[str] = field(default_factory=list)
    resumes: int = 0


class _BadPeer(AgoraError):
    """A peer's reply does not fit this worker (another run, stage or layout)."""


class StateLoader:
    def __init__(self, p2p: P2P, client: RpcClient, store: ParameterStore, layout: FlatLayout, *, run_id: str,
                 stage: int, chunk_elements: int, chunk_timeout_s: float, total_timeout_s: float,
                 max_failures_per_peer: int = 2, show_progress: bool = True):
        self.p2p = p2p
        self.client = client
        self.store = store
        self.layout = layout
        self.run_id = run_id
        self.stage = stage
        self.chunk_elements = chunk_elements
        self.chunk_timeout_s = chunk_timeout_s
        self.total_timeout_s = total_timeout_s
        self.max_failures_per_peer = max_failures_per_peer
        self.show_progress = show_progress
        self._dialed: set[str] = set()

    async def load(self, candidates: Sequence[tuple[str, list[str]]]) -> LoadResult:
        """Fill the stage's parameters from `candidates` (peer id, maddrs), resuming across them."""
        peers = list(candidates)
        if not peers:
            raise StateLoadError(f"no live worker of stage {self.stage} to load state from")
        started = time.monotonic()
        deadline = started + self.total_timeout_s
        failures: collections.Counter[str] = collections.Counter()
        result = LoadResult(step=0, elements=0, seconds=0.0)
        steps: list[int] = []
        offset, turn = 0, 0
        progress = self._progress()
        task = progress.add_task(f"stage {self.stage} state", total=4 * self.layout.numel) if progress else None
        logged_at: Optional[float] = None
        try:
            while offset < self.layout.numel:
                if not peers:
                    raise StateLoadError(f"every worker of stage {self.stage} failed; loaded {offset} of "
                                         f"{self.layout.numel} parameters")
                if time.monotonic() > deadline:
                    raise StateLoadError(f"loaded {offset} of {self.layout.numel} parameters in "
                                         f"{self.total_timeout_s:.0f}s; giving up")
                # The next peer in turn among those that failed least: a peer that just stalled is
                # retried only once every other one failed as often.
                fewest = min(failures[p] for p, _ in peers)
                rotated = peers[turn % len(peers):] + peers[:turn % len(peers)]
                peer, maddrs = next(item for item in rotated if failures[item[0]] == fewest)
                try:
                    reply = await self._fetch(peer, maddrs, offset)
                except (AgoraError, asyncio.TimeoutError, OSError) as exc:
                    bad = isinstance(exc, _BadPeer)
                    failures[peer] += self.max_failures_per_peer if bad else 1
                    if failures[peer] >= self.max_failures_per_peer:
                        peers = [p for p in peers if p[0] != peer]
                    turn += 1
                    result.resumes += 1
                    logger.warning("state chunk at element %d from %s failed (%s); %s", offset, peer, exc,
                                   f"resuming at element {offset} on another worker" if peers else "no worker left")
                    continue
                data = reply.data
                await asyncio.to_thread(self._write, offset, data)
                offset += data.numel()
                steps.append(reply.step)
                if peer not in result.peers:
                    result.peers.append(peer)
                if progress is not None:
                    progress.update(task, completed=4 * offset)
                elif self.show_progress and (logged_at is None
                                             or time.monotonic() - logged_at >= PROGRESS_LOG_PERIOD_S):
                    logged_at = time.monotonic()
                    logger.info("loading stage %d state: %d of %d parameters (%.0f%%) after %.1fs", self.stage,
                                offset, self.layout.numel, 100 * offset / self.layout.numel, logged_at - started)
            await asyncio.to_thread(self.store.push_master_to_device)
        finally:
            if progress is not None:
                progress.stop()
        result.step, result.elements = min(steps, default=0), offset
        result.seconds = time.monotonic() - started
        return result

    def _progress(self) -> Optional[Progress]:
        """The bar, on a terminal only; elsewhere `load` logs its progress instead."""
        if not self.show_progress or not sys.stderr.isatty():
            return None
        progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), console=Console(stderr=True), transient=False)
        progress.start()
        return progress

    async def _fetch(self, peer: str, maddrs: list[str], offset: int) -> StateReply:
        peer_id = PeerID.from_base58(peer)
        if peer not in self._dialed and maddrs:
            await dial(self.p2p, peer_id, maddrs, self.chunk_timeout_s)
            self._dialed.add(peer)
        reply = await self.client.request(peer_id, version.STATE,
                                          StateRequest(stage=self.stage, offset=offset, count=self.chunk_elements),
                                          StateReply, timeout_s=self.chunk_timeout_s)
        if reply.run_id != self.run_id or reply.stage != self.stage:
            raise _BadPeer(f"it serves run {reply.run_id} stage {reply.stage}")
        if reply.layout != self.layout.digest or reply.numel != self.layout.numel:
            raise _BadPeer(f"its parameter layout {reply.layout} ({reply.numel} values) differs from ours "
                           f"{self.layout.digest} ({self.layout.numel})")
        data = reply.data
        if reply.offset != offset or data is None or data.dim() != 1 or data.dtype != torch.float32:
            raise _BadPeer(f"it answered offset {offset} with a malformed chunk")
        if not 0 < data.numel() <= min(self.chunk_elements, self.layout.numel - offset):
            raise _BadPeer(f"it sent {data.numel()} values for a chunk of at most {self.chunk_elements}")
        if not bool(torch.isfinite(data).all()):
            raise _BadPeer("it sent non-finite parameters")
        return reply

    def _write(self, offset: int, data: torch.Tensor) -> None:
        with self.store.lock:
            self.layout.write(self.store.master_params, offset, data)
