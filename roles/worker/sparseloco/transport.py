"""How SparseLoCo fragments travel between the replicas of a stage: one interface, two ways.

- `SwarmTransport`: a replica pushes its signed fragment (`agora/v1/sparseloco_fragment`) to every
  other replica of the stage with a live progress record, over the swarm's authenticated streams,
  and waits for theirs: an all-gather with no collective to break. A peer whose push fails and
  whose fragment is not here is dead or gone: nobody waits for it.
- `StoreTransport`: as Crucible does it, a replica uploads its fragment to an object store
  (fsspec: a directory, s3://...) under the round's prefix and fetches the others' there. Replicas
  never talk directly; one that died after its upload is still counted.

Either way, `exchange` returns the raw bytes that arrived by the deadline, by sender; checking them
(signature, shape, finiteness, norm) is the service's, the same for both.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import posixpath
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from fsspec.implementations.local import LocalFileSystem

from protocol.errors import ErrorCode, ProtocolError

logger = logging.getLogger(__name__)

POLL_S = 0.2
ROUND_WINDOW = 4
"""Rounds of fragments an inbox holds ahead of and behind this replica's newest (a replica a little
ahead pushes before this one captured; one far away is refused)."""


@dataclass(frozen=True)
class RoundKey:
    round: int
    fragment: int


@dataclass
class Exchanged:
    """What one exchange moved: the others' fragments by sender, and the bytes each way."""

    received: dict[str, bytes]
    bytes_sent: int
    bytes_received: int
    expected: tuple[str, ...]
    unreachable: tuple[str, ...] = ()


class FragmentTransport(Protocol):
    name: str

    async def exchange(self, key: RoundKey, data: bytes, deadline: float) -> Exchanged:
        """Send `data` and return what the others sent by `deadline`."""

    async def close(self) -> None: ...


class FragmentInbox:
    """Fragments pushed to this replica, by round, until the round is exchanged. Bounded: a
    window of rounds around the newest one this replica captured, one fragment per sender each."""

    def __init__(self, max_bytes: Callable[[int], int], window: int = ROUND_WINDOW):
        self.max_bytes = max_bytes
        """The largest fragment `fragment` may be (its arithmetic plus the header budget)."""
        self.window = window
        self.newest = -1
        """The newest round this replica has captured; the window is around it."""
        self._held: dict[RoundKey, dict[str, bytes]] = collections.defaultdict(dict)
        self._changed = asyncio.Event()
        self.counters: collections.Counter[str] = collections.Counter()

    def put(self, sender: str, key: RoundKey, data: bytes, round_step: int) -> None:
        """Take a pushed fragment. Raises ProtocolError for one this replica will never use."""
        if len(data) > self.max_bytes(key.fragment):
            self.counters["refused_size"] += 1
            raise ProtocolError(f"a fragment of {len(data)} bytes; fragment {key.fragment} is at most "
                                f"{self.max_bytes(key.fragment)}", ErrorCode.FRAME_TOO_LARGE)
        if self.newest >= 0 and not (self.newest - self.window * round_step <= key.round
                                     <= self.newest + self.window * round_step):
            self.counters["refused_round"] += 1
            raise ProtocolError(f"round {key.round} is far from this replica's ({self.newest})",
                                ErrorCode.INVALID_REQUEST)
        if self.newest >= 0:  # late fragments of rounds already exchanged (or sat out) are dropped
            self.forget_before(self.newest - self.window * round_step)
        held = self._held[key]
        if sender in held:
            self.counters["refused_repeat"] += 1
            raise ProtocolError(f"round {key.round} fragment {key.fragment} already came from this sender",
                                ErrorCode.INVALID_REQUEST)
        held[sender] = bytes(data)
        self.counters["taken"] += 1
        self._changed.set()

    def has(self, key: RoundKey, sender: str) -> bool:
        return sender in self._held.get(key, {})

    def take(self, key: RoundKey) -> dict[str, bytes]:
        return self._held.pop(key, {})

    async def changed(self, timeout_s: float) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def forget_before(self, round_id: int) -> None:
        for key in [k for k in self._held if k.round < round_id]:
            del self._held[key]


Push = Callable[[str, RoundKey, bytes, float], Awaitable[int]]
"""Sends a fragment to one peer by the deadline; returns the bytes it put on the wire (the request's frame)."""


class SwarmTransport:
    """Push to every live replica of the stage, gather from the inbox."""

    name = "swarm"

    def __init__(self, self_id: str, inbox: FragmentInbox, push: Push, members: Callable[[], list[str]]):
        self.self_id = self_id
        self.inbox = inbox
        self.push = push
        self.members = members

    async def exchange(self, key: RoundKey, data: bytes, deadline: float) -> Exchanged:
        expected = sorted(set(self.members()) - {self.self_id})
        pushes = {peer: asyncio.create_task(self.push(peer, key, data, deadline), name=f"sparseloco-push-{key.round}")
                  for peer in expected}
        unreachable: set[str] = set()
        try:
            while True:
                for peer, task in pushes.items():
                    if task.done() and peer not in unreachable and task.exception() is not None:
                        unreachable.add(peer)
                        logger.info("round %d fragment %d: replica %s did not take this replica's fragment (%s)",
                                    key.round, key.fragment, peer[-8:], task.exception())
                waiting = [p for p in expected if not self.inbox.has(key, p) and p not in unreachable]
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    break
                await self.inbox.changed(min(left, POLL_S))
            # Our pushes get until the deadline too: a peer that has ours but we lack its is still
            # better off with ours.
            pending = [t for t in pushes.values() if not t.done()]
            if pending:
                await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for task in pushes.values():
                if not task.done():
                    task.cancel()
        sent = sum(task.result() for task in pushes.values()
                   if task.done() and not task.cancelled() and task.exception() is None)
        received = self.inbox.take(key)
        return Exchanged(received, sent, sum(map(len, received.values())), tuple(expected), tuple(sorted(unreachable)))

    async def close(self) -> None:
        return None


class StoreTransport:
    """Upload to `{url}/{run}/sparseloco/stage-{s}/r{round}-f{fragment}/{peer}.frag`, list and
    fetch the others' there. fsspec's calls block, so they run in threads, bounded by the deadline."""

    name = "store"
    KEEP_ROUNDS = 4
    """Own uploads older than this many rounds of this replica are deleted."""

    def __init__(self, url: str, run_id: str, stage: int, self_id: str, members: Callable[[], list[str]],
                 max_bytes: Callable[[int], int]):
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = posixpath.join(root.rstrip("/"), run_id, "sparseloco", f"stage-{stage}")
        self.self_id = self_id
        self.members = members
        self.max_bytes = max_bytes
        self._uploaded: collections.deque[str] = collections.deque()
        self.errors = 0

    def _dir(self, key: RoundKey) -> str:
        return posixpath.join(self.root, f"r{key.round:010d}-f{key.fragment}")

    def _put(self, path: str, data: bytes) -> None:
        """Write atomically: readers list only finished names (object stores put whole objects; a
        directory gets a temporary name renamed into place)."""
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        if isinstance(self.fs, LocalFileSystem):
            tmp = f"{path}.{uuid.uuid4().hex}.part"
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def _list(self, key: RoundKey) -> dict[str, int]:
        # fsspec caches listings (s3fs's dircache): a cached one never shows a later upload
        self.fs.invalidate_cache(self._dir(key))
        try:
            entries = self.fs.ls(self._dir(key), detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for e in entries:
            name = posixpath.basename(e["name"].rstrip("/"))
            if name.endswith(".frag"):
                out[name[:-len(".frag")]] = int(e.get("size") or 0)
        return out

    def _get(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    async def _timed(self, deadline: float, fn, *args):
        left = deadline - time.monotonic()
        if left <= 0:
            raise asyncio.TimeoutError()
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), left)

    async def exchange(self, key: RoundKey, data: bytes, deadline: float) -> Exchanged:
        path = posixpath.join(self._dir(key), f"{self.self_id}.frag")
        sent = 0
        try:
            await self._timed(deadline, self._put, path, data)
            sent = len(data)
            self._uploaded.append(self._dir(key))
        except Exception as exc:  # noqa: BLE001 - the store is an edge: log, count, go on without it
            self.errors += 1
            logger.warning("round %d fragment %d: could not upload to the store (%s)", key.round, key.fragment, exc)
        expected = sorted(set(self.members()) - {self.self_id})
        received: dict[str, bytes] = {}
        refused: set[str] = set()
        while True:
            try:
                listed = await self._timed(deadline, self._list, key)
            except Exception as exc:  # noqa: BLE001
                self.errors += 1
                logger.debug("listing the store failed (%s)", exc)
                listed = {}
            for peer, size in sorted(listed.items()):
                if peer == self.self_id or peer in received or peer in refused:
                    continue
                if size > self.max_bytes(key.fragment):
                    refused.add(peer)
                    logger.warning("round %d: %s uploaded %d bytes, more than a fragment can be; ignored",
                                   key.round, peer[-8:], size)
                    continue
                try:
                    path = posixpath.join(self._dir(key), f"{peer}.frag")
                    received[peer] = await self._timed(deadline, self._get, path)
                except Exception as exc:  # noqa: BLE001
                    self.errors += 1
                    logger.debug("fetching %s's fragment failed (%s)", peer[-8:], exc)
            if all(p in received for p in expected) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        await self._tidy()
        return Exchanged(received, sent, sum(map(len, received.values())), tuple(expected))

    async def _tidy(self) -> None:
        while len(self._uploaded) > self.KEEP_ROUNDS:
            old = self._uploaded.popleft()
            try:
                await asyncio.wait_for(asyncio.to_thread(self.fs.rm, posixpath.join(old, f"{self.self_id}.frag")), 10)
            except Exception:  # noqa: BLE001 - leftovers cost space, not correctness
                pass

    async def close(self) -> None:
        return None
