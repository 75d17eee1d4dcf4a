"""A worker as a donor of its stage's state to joiners: `agora/v1/state_manifest` and
`agora/v1/state_chunk`.

On the first manifest request the donor freezes its state (parameters and optimizer state, under
the optimizer's lock, as the run checkpoint's writer does) into a canonical snapshot
(state_snapshot.py), hashes its chunks off the event loop, and publishes the manifest. It keeps
that one snapshot while joiners use it, so joiners that arrive together share it and every donor
that holds the same bytes publishes the same id; `snapshot_ttl_s` after the last request it is
dropped (its memory, one copy of the stage's state, is freed) and the next manifest request
freezes a fresh one; so does a manifest request once the stage has stepped past an idle
snapshot. A chunk request for another id is answered STATE_GONE: the joiner fetches that chunk
elsewhere, or starts over on a fresh manifest.

Serving joiners must not starve the donor's own training: a token bucket caps the bytes per
second it uploads to joiners (`sync.donor_upload_mbps`), and at most
`sync.donor_max_concurrent_chunks` chunk requests are served at once; one beyond that is answered
OVERLOADED at once (the joiner asks another donor) rather than queued. Every request is validated
field by field (protocol/state_messages.py), refusals are typed and counted by code.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from hivemind.p2p import PeerID

from protocol.errors import AgoraError, ErrorCode, ProtocolError
from protocol.messages import parse_model
from protocol.state_messages import ChunkReply, ChunkRequest, ManifestReply, ManifestRequest
from roles.worker.state import state_snapshot
from roles.worker.layout import FlatLayout

logger = logging.getLogger(__name__)

SNAPSHOT_IDLE_BEFORE_REFREEZE_S = 2.0
"""A snapshot no chunk was read from for this long is not in a download (a joiner reads its
chunks back to back), so a new joiner may get a fresh one instead."""


class TokenBucket:
    """At most `rate_bytes_s` on average, bursts up to `burst_bytes`. Takers queue in arrival
    order (the lock): a big chunk waits its turn instead of starving behind small ones."""

    def __init__(self, rate_bytes_s: float, burst_bytes: int, clock: Callable[[], float] = time.monotonic):
        if rate_bytes_s <= 0 or burst_bytes <= 0:
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate = rate_bytes_s
        self.burst = burst_bytes
        self.clock = clock
        self.tokens = float(burst_bytes)
        self.updated = clock()
        self.waited_s = 0.0
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    async def take(self, n: int) -> float:
        """Wait until `n` bytes may go; returns the seconds waited."""
        async with self._lock:
            self._refill()
            self.tokens -= n
            if self.tokens >= 0:
                return 0.0
            wait = -self.tokens / self.rate
            await asyncio.sleep(wait)
            self._refill()
            self.waited_s += wait
            return wait


@dataclass
class _Snapshot:
    blob: bytearray
    manifest: state_snapshot.Manifest
    last_used: float


class StateDonor:
    """Serves frozen snapshots of one stage's state; `counters` go to `agora/v1/info` and the summary."""

    def __init__(self, optimizer, layout: FlatLayout, *, run_id: str, stage: int, serving: Callable[[], bool],
                 chunk_bytes: int, upload_mbps: float, max_concurrent_chunks: int, snapshot_ttl_s: float):
        self.optimizer = optimizer
        self.layout = layout
        self.run_id = run_id
        self.stage = stage
        self.serving = serving
        self.chunk_bytes = chunk_bytes
        self.bucket = TokenBucket(upload_mbps * 1e6 / 8, burst_bytes=chunk_bytes)
        self.max_concurrent_chunks = max_concurrent_chunks
        self.snapshot_ttl_s = snapshot_ttl_s
        self.counters: collections.Counter[str] = collections.Counter()
        self._snapshot: Optional[_Snapshot] = None
        self._freezing = asyncio.Lock()
        self._active = 0
        self._expiry: Optional[asyncio.TimerHandle] = None

    # ---- handlers ----

    async def manifest(self, peer_id: PeerID, body: dict) -> ManifestReply:
        return await self._counted("manifest", self._manifest(body))

    async def chunk(self, peer_id: PeerID, body: dict) -> ChunkReply:
        return await self._counted("chunk", self._chunk(body))

    async def _counted(self, kind: str, call):
        try:
            return await call
        except AgoraError as exc:
            code = ErrorCode(getattr(exc, "code", ErrorCode.NOT_READY)).name.lower()
            self.counters[f"donor_{kind}_refused_{code}"] += 1
            raise

    def _check(self, stage: int) -> None:
        if stage != self.stage:
            raise ProtocolError(f"this worker serves stage {self.stage}, not {stage}", ErrorCode.WRONG_STAGE)
        if not self.serving():
            raise ProtocolError("this worker is not donating its state now (starting, leaving or syncing); ask "
                                "another donor of the stage", ErrorCode.NOT_READY)

    async def _manifest(self, body: dict) -> ManifestReply:
        request = parse_model(ManifestRequest, body)
        self._check(request.stage)
        async with self._freezing:  # joiners asking together share one snapshot
            snapshot = self._snapshot
            if snapshot is not None and self._outdated(snapshot):
                self.counters["donor_snapshots_outdated"] += 1
                snapshot = None
            if snapshot is None:
                snapshot = await self._freeze()
            snapshot.last_used = time.monotonic()
        self.counters["donor_manifests_served"] += 1
        return snapshot.manifest.to_reply()

    async def _chunk(self, body: dict) -> ChunkReply:
        request = parse_model(ChunkRequest, body)
        self._check(request.stage)
        snapshot = self._snapshot
        if snapshot is None or snapshot.manifest.manifest_id != request.manifest_id:
            raise ProtocolError("this donor no longer holds that snapshot; fetch its manifest again",
                                ErrorCode.STATE_GONE)
        if request.index >= snapshot.manifest.num_chunks:
            raise ProtocolError(f"chunk {request.index} of a snapshot of {snapshot.manifest.num_chunks} chunks",
                                ErrorCode.INVALID_REQUEST)
        if self._active >= self.max_concurrent_chunks:
            raise ProtocolError(f"{self.max_concurrent_chunks} state chunks are being served here already; ask "
                                "another donor or retry", ErrorCode.OVERLOADED)
        self._active += 1
        try:
            snapshot.last_used = time.monotonic()
            start, end = snapshot.manifest.chunk_range(request.index)
            waited = await self.bucket.take(end - start)
            self.counters["donor_throttled_ms"] += int(waited * 1000)
            data = bytes(memoryview(snapshot.blob)[start:end])
            snapshot.last_used = time.monotonic()
        finally:
            self._active -= 1
        self.counters["donor_chunks_served"] += 1
        self.counters["donor_bytes_served"] += end - start
        return ChunkReply(manifest_id=request.manifest_id, index=request.index, data=data)

    # ---- the snapshot ----

    def _outdated(self, snapshot: _Snapshot) -> bool:
        """The stage has stepped since the snapshot and nobody is downloading it: a new joiner
        gets the state as it is now. (Under churn a snapshot kept for its TTL handed a joiner
        state 56 steps old, and the joiner spent its first minutes in weight sync.)"""
        idle = time.monotonic() - snapshot.last_used
        return (self.optimizer.local_step > snapshot.manifest.step and not self._active
                and idle >= SNAPSHOT_IDLE_BEFORE_REFREEZE_S)

    async def _freeze(self) -> _Snapshot:
        started = time.monotonic()
        step, blob = await asyncio.to_thread(self._serialize)
        manifest = await asyncio.to_thread(state_snapshot.describe, blob, self.chunk_bytes, run_id=self.run_id,
                                           stage=self.stage, step=step, layout=self.layout.digest)
        self._snapshot = _Snapshot(blob, manifest, time.monotonic())
        self.counters["donor_snapshots_frozen"] += 1
        logger.info("froze stage %d at step %d for joiners: %.1f MB in %d chunks, manifest %s (%.2fs)", self.stage,
                    step, len(blob) / 1e6, manifest.num_chunks, manifest.manifest_id[:12],
                    time.monotonic() - started)
        self._schedule_expiry(self.snapshot_ttl_s)
        return self._snapshot

    def _serialize(self) -> tuple[int, bytearray]:
        with self.optimizer.lock:
            step = self.optimizer.local_step
            return step, state_snapshot.freeze(self.layout.names, self.optimizer.master_params,
                                               self.optimizer.state_dict(), run_id=self.run_id, stage=self.stage,
                                               step=step, layout=self.layout.digest)

    def _schedule_expiry(self, delay_s: float) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(max(delay_s, 0.01), self._expire)

    def _expire(self) -> None:
        snapshot = self._snapshot
        if snapshot is None:
            return
        idle = time.monotonic() - snapshot.last_used
        if idle < self.snapshot_ttl_s or self._active:
            self._schedule_expiry(self.snapshot_ttl_s - idle)
            return
        self._snapshot = None
        self.counters["donor_snapshots_dropped"] += 1
        logger.info("dropped stage %d's snapshot %s: no joiner asked for it in %.0fs", self.stage,
                    snapshot.manifest.manifest_id[:12], idle)

    def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._snapshot = None
