"""A joiner's multi-donor download of one stage snapshot.

The snapshot is fixed by one manifest (state_snapshot.Manifest): every chunk must hash to what
the manifest lists, whichever donor sends it. Each donor (a `ChunkSource`) gets a queue of
chunks, dealt round-robin, and `inflight_per_source` requests at a time. Work stealing keeps every
donor busy: a donor whose queue is empty takes the last chunk of the longest other queue, and at
the end ("endgame") asks for a chunk another donor has had in flight longer than
`endgame_after_s`, so one slow donor cannot hold up the last percent; the first copy to arrive
wins. A chunk that fails (timeout, refusal, dead donor) goes back to the front of another live
donor's queue and is never asked of that donor again; a donor that fails `max_failures` times is
dropped and its queue dealt out to the others. A chunk whose hash is wrong is refused, the donor
is named and dropped at once (it serves other bytes than it published), and the chunk is fetched
elsewhere.

The download fails (StateLoadError) when no donor is left that may still be asked for a missing
chunk, or after `total_timeout_s`; the caller then falls back to the old path.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

from protocol.errors import AgoraError, ErrorCode, PeerTimeout, PeerUnavailable, RemoteError
from roles.worker.errors import StateLoadError
from roles.worker.state.state_snapshot import Manifest

logger = logging.getLogger(__name__)

PROGRESS_LOG_PERIOD_S = 5.0
BUSY_BACKOFF_S = 0.2
"""How long a worker waits after a donor said it is busy (OVERLOADED) before its next request."""


class ChunkSource(Protocol):
    """A donor of one manifest's chunks: a live replica (`DonorSource`) or a test's fake."""

    name: str

    async def chunk(self, index: int) -> bytes: ...


class BadChunk(AgoraError):
    """A donor sent bytes that do not hash to the manifest's chunk."""


@dataclass
class DonorOutcome:
    chunks: int = 0
    bytes: int = 0
    failures: collections.Counter = field(default_factory=collections.Counter)
    """By kind: timeout, unavailable, bad_hash, or the code of a typed refusal (overloaded, state_gone, ...)."""
    wasted: int = 0
    """Endgame copies that arrived after another donor's copy of the same chunk."""
    dropped: Optional[str] = None

    def to_json(self) -> dict:
        return {"chunks": self.chunks, "bytes": self.bytes, "failures": dict(self.failures), "wasted": self.wasted,
                "dropped": self.dropped}


@dataclass
class DownloadResult:
    manifest: Manifest
    seconds: float
    donors: dict[str, DonorOutcome]
    requeued: int = 0
    stolen: int = 0
    endgame: int = 0

    def summary(self) -> dict:
        return {"manifest": self.manifest.manifest_id[:16], "step": self.manifest.step,
                "bytes": self.manifest.total_bytes, "chunks": self.manifest.num_chunks,
                "seconds": round(self.seconds, 3), "requeued": self.requeued, "stolen": self.stolen,
                "endgame": self.endgame, "donors": {name[-12:]: o.to_json() for name, o in self.donors.items()}}


def _kind(exc: BaseException) -> str:
    if isinstance(exc, BadChunk):
        return "bad_hash"
    if isinstance(exc, (PeerTimeout, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(exc, RemoteError):
        return ErrorCode(exc.code).name.lower()
    if isinstance(exc, PeerUnavailable):
        return "unavailable"
    return type(exc).__name__.lower()


_RETRY_SOON = frozenset({"overloaded", "rate_limited"})
"""Refusals that say "not now" rather than "not this donor": they do not count towards dropping it."""


class MultiDonorDownload:
    def __init__(self, manifest: Manifest, sources: Sequence[ChunkSource], *, chunk_timeout_s: float,
                 total_timeout_s: float, inflight_per_source: int = 2, max_failures: int = 3,
                 endgame_after_s: float = 2.0, show_progress: bool = True,
                 on_chunk: Optional[Callable[[int, str], None]] = None):
        if not sources:
            raise StateLoadError(f"no donor publishes manifest {manifest.manifest_id[:12]}")
        self.manifest = manifest
        self.sources = list(sources)
        self.chunk_timeout_s = chunk_timeout_s
        self.total_timeout_s = total_timeout_s
        self.inflight_per_source = inflight_per_source
        self.max_failures = max_failures
        self.endgame_after_s = endgame_after_s
        self.show_progress = show_progress
        self.on_chunk = on_chunk
        n = manifest.num_chunks
        self.blob = bytearray(manifest.total_bytes)
        self.done = [False] * n
        self.remaining = n
        self.queues: dict[str, collections.deque[int]] = {s.name: collections.deque() for s in self.sources}
        for index in range(n):
            self.queues[self.sources[index % len(self.sources)].name].append(index)
        self.refused: dict[int, set[str]] = collections.defaultdict(set)
        """Donors a chunk failed on: it is not asked of them again."""
        self.inflight: dict[int, dict[str, float]] = collections.defaultdict(dict)
        self.alive: set[str] = {s.name for s in self.sources}
        self.outcomes: dict[str, DonorOutcome] = {s.name: DonorOutcome() for s in self.sources}
        self.result = DownloadResult(manifest=manifest, seconds=0.0, donors=self.outcomes)
        self._changed = asyncio.Event()
        self._finished = asyncio.Event()
        self._error: Optional[str] = None
        self._bytes_done = 0

    # ---- scheduling (event loop only: no locks needed) ----

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _next(self, name: str) -> Optional[int]:
        """The next chunk for donor `name`: its own queue, else stolen, else an endgame copy."""
        queue = self.queues[name]
        while queue:
            index = queue.popleft()
            if not self.done[index] and name not in self.refused[index]:
                return index
        for other in sorted(self.queues, key=lambda k: -len(self.queues[k])):
            if other == name:
                continue
            q = self.queues[other]
            for _ in range(len(q)):
                index = q.pop()
                if not self.done[index] and name not in self.refused[index]:
                    self.result.stolen += 1
                    return index
                if not self.done[index]:
                    q.appendleft(index)  # one this donor may not take: the owner keeps it
        now = time.monotonic()
        oldest: Optional[tuple[float, int]] = None
        for index, holders in self.inflight.items():
            if not holders or self.done[index] or name in holders or name in self.refused[index] or len(holders) > 1:
                continue
            started = min(holders.values())
            if now - started >= self.endgame_after_s and (oldest is None or started < oldest[0]):
                oldest = (started, index)
        if oldest is not None:
            self.result.endgame += 1
            return oldest[1]
        return None

    def _requeue(self, index: int, failed: str) -> None:
        """Put a failed chunk at the front of the shortest queue of a live donor it may still go to."""
        candidates = [n for n in self.alive if n not in self.refused[index]]
        if not candidates:
            if not self.inflight.get(index):
                self._fail(f"chunk {index} failed on every donor ({', '.join(sorted(self.refused[index]))})")
            return
        target = min(candidates, key=lambda n: len(self.queues[n]))
        self.queues[target].appendleft(index)
        self.result.requeued += 1

    def _drop(self, name: str, why: str) -> None:
        if name not in self.alive:
            return
        self.alive.discard(name)
        self.outcomes[name].dropped = why
        logger.warning("state donor %s dropped: %s; its chunks go to %d other donor(s)", name[-12:], why,
                       len(self.alive))
        orphans = list(self.queues[name])
        self.queues[name].clear()
        for index in orphans:
            if not self.done[index]:
                self.refused[index].add(name)
                self._requeue(index, name)
        if not self.alive and self.remaining:
            self._fail(f"every donor failed ({'; '.join(f'{n[-12:]}: {o.dropped}' for n, o in self.outcomes.items())})")

    def _fail(self, why: str) -> None:
        if self._error is None:
            self._error = why
            self._finished.set()

    # ---- workers ----

    async def _worker(self, source: ChunkSource) -> None:
        try:
            await self._serve_worker(source)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must end the download at once, not after total_timeout_s
            logger.exception("the state download's worker for donor %s failed", source.name[-12:])
            self._fail(f"internal error: {type(exc).__name__}: {exc}")

    async def _serve_worker(self, source: ChunkSource) -> None:
        name = source.name
        while name in self.alive and not self._finished.is_set():
            index = self._next(name)
            if index is None:
                if self.remaining == 0:
                    return
                changed = self._changed
                try:
                    await asyncio.wait_for(changed.wait(), self.endgame_after_s / 2)
                except asyncio.TimeoutError:
                    pass
                continue
            self.inflight[index][name] = time.monotonic()
            try:
                data = await asyncio.wait_for(source.chunk(index), self.chunk_timeout_s)
                await self._verify(index, data)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure of a donor is counted and routed around
                self.inflight[index].pop(name, None)
                self._failed(index, name, exc)
                self._notify()
                if _kind(exc) in _RETRY_SOON:
                    await asyncio.sleep(BUSY_BACKOFF_S)
                continue
            self.inflight[index].pop(name, None)
            self._arrived(index, name, data)
            self._notify()

    async def _verify(self, index: int, data: bytes) -> None:
        start, end = self.manifest.chunk_range(index)
        if len(data) != end - start:
            raise BadChunk(f"chunk {index} has {len(data)} bytes, the manifest says {end - start}")
        digest = await asyncio.to_thread(lambda: hashlib.sha256(data).digest())
        if digest != self.manifest.chunks[index]:
            raise BadChunk(f"chunk {index} does not hash to the manifest's SHA-256")

    def _failed(self, index: int, name: str, exc: BaseException) -> None:
        kind = _kind(exc)
        outcome = self.outcomes[name]
        outcome.failures[kind] += 1
        if self.done[index]:
            return
        if kind in _RETRY_SOON:  # the donor is busy: the chunk waits at the back of its queue (or is stolen)
            if name in self.alive:
                self.queues[name].append(index)
            else:
                self._requeue(index, name)
            return
        logger.warning("state chunk %d from donor %s failed (%s: %s); fetching it from another donor", index,
                       name[-12:], kind, exc)
        self.refused[index].add(name)
        if kind == "bad_hash":
            self._drop(name, f"it served chunk {index} with a wrong hash")
        elif sum(n for k, n in outcome.failures.items() if k not in _RETRY_SOON) >= self.max_failures:
            self._drop(name, f"{sum(outcome.failures.values())} failed chunk requests ({dict(outcome.failures)})")
        if not self.done[index] and not any(index in q for q in self.queues.values()):
            self._requeue(index, name)

    def _arrived(self, index: int, name: str, data: bytes) -> None:
        outcome = self.outcomes[name]
        if self.done[index]:
            outcome.wasted += 1
            return
        start, end = self.manifest.chunk_range(index)
        self.blob[start:end] = data
        self.done[index] = True
        self.remaining -= 1
        self._bytes_done += end - start
        outcome.chunks += 1
        outcome.bytes += end - start
        if self.show_progress and self._bytes_done == end - start:
            logger.info("loading stage %d state: first chunk of %d from donor %s", self.manifest.stage,
                        self.manifest.num_chunks, name[-12:])
        if self.on_chunk is not None:
            self.on_chunk(index, name)
        if self.remaining == 0:
            self._finished.set()

    async def run(self) -> tuple[bytearray, DownloadResult]:
        """Fetch every chunk; the assembled bytes (each chunk verified) and what each donor did."""
        started = time.monotonic()
        workers = [asyncio.create_task(self._worker(s), name=f"state-donor-{s.name[-8:]}-{k}")
                   for s in self.sources for k in range(self.inflight_per_source)]
        progress = asyncio.create_task(self._log_progress(started))
        try:
            await asyncio.wait_for(self._finished.wait(), self.total_timeout_s)
        except asyncio.TimeoutError:
            self._fail(f"{self.manifest.num_chunks - self.remaining} of {self.manifest.num_chunks} chunks in "
                       f"{self.total_timeout_s:.0f}s")
        finally:
            for task in (*workers, progress):
                task.cancel()
            await asyncio.gather(*workers, progress, return_exceptions=True)
        self.result.seconds = time.monotonic() - started
        if self.remaining:
            raise StateLoadError(f"the download of stage state {self.manifest.manifest_id[:12]} failed: "
                                 f"{self._error or 'unfinished'}")
        return self.blob, self.result

    async def _log_progress(self, started: float) -> None:
        if not self.show_progress:
            return
        while True:
            await asyncio.sleep(PROGRESS_LOG_PERIOD_S)
            total = self.manifest.total_bytes
            logger.info("loading stage %d state: %.1f of %.1f MB (%.0f%%) from %d donor(s) after %.1fs",
                        self.manifest.stage, self._bytes_done / 1e6, total / 1e6, 100 * self._bytes_done / total,
                        len(self.alive), time.monotonic() - started)
