"""Task queues and batch coalescing between a worker's handlers and its compute thread [3.3.1.2-3].

Trainers send one sample per request so that any sample can go to any worker of the stage,
whatever its VRAM. The handlers (asyncio) `submit` each validated request as a `Task`; one compute
thread calls `next_batch`, which serves whichever queue, forward or backward, holds the oldest
request and merges into it the same-kind requests that piled up while the last batch ran, up to
`max_batch`. `run_batch` then runs the batch and hands each result back to its own requester.

The queues are plain threads-and-locks code: the compute thread must not need the event loop, and
the handlers only hold the lock for an append. Nothing queued is ever dropped silently: `close`
returns what is left so the caller can fail it with a typed error.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import AgoraError, ErrorCode

logger = logging.getLogger(__name__)


class QueueFull(AgoraError):
    """The worker already holds `max_pending` requests; the trainer should route elsewhere."""

    code = ErrorCode.OVERLOADED



def loop_future() -> tuple[asyncio.Future, Callable[[Any, BaseException | None], None]]:
    """A future on the running event loop and the `on_done(result, exc)` that settles it from the
    compute thread: how a handler waits for work it handed that thread (a future already settled
    or cancelled, its caller gone, is left alone)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result, exc) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def on_done(result, exc) -> None:
        loop.call_soon_threadsafe(settle, result, exc)

    return future, on_done

class QueueClosed(AgoraError):
    """The worker is shutting down and accepts no more requests."""

    code = ErrorCode.NOT_READY


class Superseded(AgoraError):
    """A newer request for the same sample arrived while this one still waited: its caller gave
    up on it (timed out and retried), so running it would only waste compute and a gate slot."""

    code = ErrorCode.OVERLOADED


class BatchResultMismatch(AgoraError):
    """The compute function returned a different number of results than it was given requests."""

    code = ErrorCode.INTERNAL


class TaskKind(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(eq=False)
class Task:
    """One single-sample request waiting for the compute thread.

    `on_done` is called exactly once, from the compute thread (or from `submit`'s caller for a
    task a retry superseded), with `(result, None)` or `(None, exc)`; the submitter makes it
    thread-safe (e.g. `loop.call_soon_threadsafe`).
    Only tasks with equal `group_key` (e.g. the sequence length) are merged into one batch.
    `step` is a backward's global step tag (None: untagged, the worker tags it when it runs).
    """

    kind: TaskKind
    payload: Any
    on_done: Callable[[Any, BaseException | None], None]
    enqueued_at: float = field(default_factory=time.monotonic)
    group_key: Hashable = None
    step: int | None = None
    supersede_key: Hashable = None
    """Queued tasks of the same kind with an equal key (not None) are dropped when this one arrives."""


@dataclass(frozen=True)
class QueueStats:
    """A snapshot of what the compute thread has taken, for metrics."""

    total_batches: int
    total_tasks: int
    batches_by_kind: dict[TaskKind, int]
    batch_size_counts: dict[int, int]

    @property
    def mean_batch_size(self) -> float:
        return self.total_tasks / self.total_batches if self.total_batches else 0.0


class TaskQueues:
    """The forward and backward queues of one worker, shared by many producers and one consumer."""

    def __init__(self, max_batch: int, max_pending: int = 1024):
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self._cond = threading.Condition()
        self._queues: dict[TaskKind, collections.deque[tuple[int, Task]]] = {
            kind: collections.deque() for kind in TaskKind
        }
        # Breaks ties between equal `enqueued_at` by arrival, so "oldest" is always well defined.
        self._seq = itertools.count()
        self._front = itertools.count(-1, -1)
        """Sequence numbers for requeued tasks: below every queued one, so they stay oldest."""
        self._max_pending = max_pending
        self._max_batch = 1
        self.max_batch = max_batch
        self._closed = False
        self._woken = False
        self._total_batches = 0
        self._total_tasks = 0
        self._batches_by_kind = {kind: 0 for kind in TaskKind}
        self._batch_size_counts: collections.Counter[int] = collections.Counter()
        self.superseded = 0

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @max_batch.setter
    def max_batch(self, value: int) -> None:
        """Settable so the worker can shrink its batches after running short of memory."""
        if value < 1:
            raise ValueError(f"max_batch must be at least 1, got {value}")
        self._max_batch = value

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, task: Task) -> None:
        with self._cond:
            if self._closed:
                raise QueueClosed("this worker is shutting down; send the request to another worker")
            if sum(len(q) for q in self._queues.values()) >= self._max_pending:
                raise QueueFull(
                    f"worker already holds {self._max_pending} pending requests; retry on another worker"
                )
            superseded = self._drop_superseded(task)
            self._queues[task.kind].append((next(self._seq), task))
            self._cond.notify()
        for old in superseded:
            old.on_done(None, Superseded("a newer request for this sample arrived; this one was dropped unrun"))

    def _drop_superseded(self, task: Task) -> list[Task]:
        """Remove and return the queued tasks `task` replaces (hold the condition's lock)."""
        if task.supersede_key is None:
            return []
        queue = self._queues[task.kind]
        kept = [(seq, t) for seq, t in queue if t.supersede_key != task.supersede_key]
        if len(kept) == len(queue):
            return []
        dropped = [t for _, t in queue if t.supersede_key == task.supersede_key]
        queue.clear()
        queue.extend(kept)
        self.superseded += len(dropped)
        return dropped

    def next_batch(self, timeout: float | None = None, *, hold_after: int | None = None,
                   untagged_limit: int | None = None, forward_limit: int | None = None) -> list[Task]:
        """Block until eligible work exists (or `timeout` passes, `wake` is called, or the queues
        close), then take one batch.

        Eligible: a forward while `forward_limit` is not 0; a tagged backward whose step is at most
        `hold_after` (later ones are held until the stage steps); an untagged backward while
        `untagged_limit` is not 0.
        The batch comes from the queue whose oldest eligible request is the oldest, so neither
        pass can starve the other, and holds that request plus the following eligible tasks of
        the same queue with its `group_key`, oldest first, at most `max_batch` of them (and at
        most `untagged_limit` untagged ones). Returns [] on timeout, wake-up or once closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def eligible(task: Task) -> bool:
            if task.kind != TaskKind.BACKWARD:
                return forward_limit is None or forward_limit > 0
            if task.step is None:
                return untagged_limit is None or untagged_limit > 0
            return hold_after is None or task.step <= hold_after

        with self._cond:
            while True:
                if self._closed:
                    return []
                if self._woken:
                    self._woken = False
                    return []
                heads = {kind: next((e for e in q if eligible(e[1])), None) for kind, q in self._queues.items()}
                heads = {kind: e for kind, e in heads.items() if e is not None}
                if heads:
                    break
                if deadline is None:
                    self._cond.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(remaining)
            kind = min(heads, key=lambda k: (heads[k][1].enqueued_at, heads[k][0]))
            limit = self._max_batch
            head = heads[kind][1]
            if head.kind == TaskKind.BACKWARD and head.step is None and untagged_limit is not None:
                limit = min(limit, untagged_limit)
            if head.kind == TaskKind.FORWARD and forward_limit is not None:
                limit = min(limit, forward_limit)
            batch = self._take(self._queues[kind], heads[kind], eligible, limit)
            self._total_batches += 1
            self._total_tasks += len(batch)
            self._batches_by_kind[kind] += 1
            self._batch_size_counts[len(batch)] += 1
            return batch

    def _take(self, queue: collections.deque[tuple[int, Task]], head: tuple[int, Task],
              eligible: Callable[[Task], bool], limit: int) -> list[Task]:
        key = head[1].group_key
        taken: list[Task] = []
        kept: list[tuple[int, Task]] = []
        while queue and len(taken) < limit:
            entry = queue.popleft()
            if entry[0] >= head[0] and entry[1].group_key == key and eligible(entry[1]):
                taken.append(entry[1])
            else:
                kept.append(entry)
        queue.extendleft(reversed(kept))
        return taken

    def discard(self, task: Task) -> bool:
        """Remove `task` if it still waits (its caller left); whether it did. Its on_done is not
        called: nobody waits for it."""
        with self._cond:
            queue = self._queues[task.kind]
            for entry in queue:
                if entry[1] is task:
                    queue.remove(entry)
                    return True
            return False

    def requeue(self, tasks: list[Task]) -> None:
        """Put tasks the consumer took but cannot run yet back at the front, in their order (a
        tail replica whose stage's tagger had no tag for them yet). Once closed, they are answered
        as `close` answers queued work: the caller gets them back."""
        if not tasks:
            return
        with self._cond:
            if self._closed:
                raise QueueClosed("this worker is shutting down; send the request to another worker")
            for task in reversed(tasks):
                self._queues[task.kind].appendleft((next(self._front), task))
            self._cond.notify()

    def wake(self) -> None:
        """Make a waiting `next_batch` return at once, so the consumer re-reads what it may take."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def held(self, hold_after: int) -> tuple[int, int | None]:
        """Tagged backward requests waiting for a step later than `hold_after`: how many, and the
        earliest step among them."""
        with self._cond:
            steps = [task.step for _, task in self._queues[TaskKind.BACKWARD]
                     if task.step is not None and task.step > hold_after]
            return len(steps), min(steps, default=None)

    def close(self) -> list[Task]:
        """Stop accepting work, wake the consumer, and return every task still queued, oldest first."""
        with self._cond:
            self._closed = True
            left = sorted(itertools.chain.from_iterable(self._queues.values()), key=lambda e: e[0])
            for queue in self._queues.values():
                queue.clear()
            self._cond.notify_all()
            return [task for _, task in left]

    def pending(self) -> dict[TaskKind, int]:
        with self._cond:
            return {kind: len(q) for kind, q in self._queues.items()}

    @property
    def stats(self) -> QueueStats:
        with self._cond:
            return QueueStats(
                total_batches=self._total_batches,
                total_tasks=self._total_tasks,
                batches_by_kind=dict(self._batches_by_kind),
                batch_size_counts=dict(self._batch_size_counts),
            )


def run_batch(tasks: list[Task], compute: Callable[[list[Any]], list[Any]]) -> None:
    """Run `compute` on the batch's payloads and deliver result i to task i.

    Any failure of the batch reaches every one of its requesters, so a bad batch fails its
    trainers quickly instead of leaving them to time out; a failing `on_done` is logged and does
    not keep the other tasks from their results.
    """
    if not tasks:
        return
    try:
        results = compute([task.payload for task in tasks])
        if len(results) != len(tasks):
            raise BatchResultMismatch(
                f"compute returned {len(results)} results for a batch of {len(tasks)} requests"
            )
    except BaseException as exc:
        for task in tasks:
            _deliver(task, None, exc)
        if not isinstance(exc, Exception):
            raise
        return
    for task, result in zip(tasks, results):
        _deliver(task, result, None)


def _deliver(task: Task, result: Any, exc: BaseException | None) -> None:
    try:
        task.on_done(result, exc)
    except Exception:
        logger.exception("on_done of a %s task raised; its requester may not be answered", task.kind.value)
