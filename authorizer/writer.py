"""Group commit: queued write operations run in shared transactions, one writer at a time.

A join must be on disk before it is answered, and a durable commit costs an fsync (about 4 ms on
the disk this was measured on: 235 commits/s for SQLite with synchronous=FULL). Committing each
request on its own would cap the authorizer there. Instead every write is a small function of a
connection; the writer takes whatever has queued up (up to `max_batch`), runs it in one
transaction, commits once, and only then resolves each caller. Under load a batch holds dozens of
joins for one fsync; at rest a batch is one operation and adds no delay.

One writer is also what SQLite wants (one write lock; waiting on it through the busy handler
sleeps in steps of up to 100 ms). The database invariants (authorizer.schema) do not rely on it.
Two writers, same contract: `GroupCommitWriter` (a thread; PostgreSQL) and `LoopWriter` (on the
event loop, only BEGIN and COMMIT in a thread; SQLite).

An operation must be re-runnable: if one raises, the batch is rolled back and each of its
operations is re-run in a transaction of its own, so one failure never fails its neighbours.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Callable, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError

logger = logging.getLogger("agora.authorizer.writer")

T = TypeVar("T")
WriteOp = Callable[[Connection], T]
_STOP = object()


class WriterClosed(RuntimeError):
    """The writer has stopped; no more operations are accepted."""


class GroupCommitWriter:
    """Runs write operations on one thread, batching concurrent ones into shared transactions."""

    def __init__(self, engine: Engine, *, max_batch: int = 128, retries: int = 3, name: str = "store-writer"):
        self._engine = engine
        self._max_batch = max_batch
        self._retries = retries
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self.batches = 0
        self.operations = 0

    def submit(self, op: WriteOp[T]) -> concurrent.futures.Future:
        if self._closed:
            raise WriterClosed("the store is shutting down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((op, future))
        return future

    async def run(self, op: WriteOp[T]) -> T:
        """Run `op` in a committed transaction and return its result (raises what it raised)."""
        return await asyncio.wrap_future(self.submit(op))

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued, then stop the thread. Idempotent."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        connection = None
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is _STOP:
                break
            batch = [first]
            while len(batch) < self._max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                batch.append(item)
            batch = [(op, fut) for op, fut in batch if fut.set_running_or_notify_cancel()]
            if not batch:
                continue
            connection = self._run_batch(connection, batch)
        if connection is not None:
            connection.close()

    def _connect(self, connection: Connection | None) -> Connection:
        if connection is None or connection.closed or connection.invalidated:
            if connection is not None:
                connection.close()
            connection = self._engine.connect()
        return connection

    def _run_batch(self, connection: Connection | None, batch: list) -> Connection | None:
        """Run the batch in one transaction, retrying transient database errors; on any other
        failure fall back to one transaction per operation."""
        for attempt in range(self._retries + 1):
            try:
                connection = self._connect(connection)
                results = []
                with connection.begin():
                    for op, _ in batch:
                        results.append(op(connection))
                self.batches += 1
                self.operations += len(batch)
                for (_, fut), result in zip(batch, results):
                    fut.set_result(result)
                return connection
            except (OperationalError, DBAPIError) as exc:
                if getattr(exc, "connection_invalidated", False) or isinstance(exc, OperationalError):
                    logger.warning("store write failed (%s); retry %d", exc.__class__.__name__, attempt + 1)
                    if connection is not None:
                        connection.close()
                        connection = None
                    time.sleep(min(1.0, 0.05 * 2**attempt))
                    continue
                break
            except Exception:  # an operation's own failure: isolate it below
                break
        if len(batch) == 1:
            return self._run_single(connection, batch[0])
        for item in batch:
            connection = self._run_single(connection, item)
        return connection

    def _run_single(self, connection: Connection | None, item: tuple) -> Connection | None:
        op, fut = item
        try:
            connection = self._connect(connection)
            with connection.begin():
                result = op(connection)
            self.operations += 1
            fut.set_result(result)
        except BaseException as exc:  # delivered to the caller, who maps it to a typed error
            if connection is not None and (connection.invalidated or isinstance(exc, OperationalError)):
                connection.close()
                connection = None
            fut.set_exception(exc)
        return connection


class LoopWriter:
    """Group commit for SQLite on the event loop's own thread; only BEGIN and COMMIT leave it.

    With a writer thread, every SQLite call releases the GIL and must win it back from the event
    loop, which under load cost more than the statements themselves (measured: ~1.7 ms of CPU per
    join). SQLite statements inside an open write transaction are microseconds of CPU and never
    wait on a lock, so they run inline on the loop; taking the write lock (BEGIN IMMEDIATE, which
    may wait for another process) and the durable COMMIT (an fsync) run in a worker thread, and
    while a commit is on disk the loop keeps serving requests, which queue up for the next batch.
    PostgreSQL keeps the thread (`GroupCommitWriter`): its statements are network round trips.
    """

    def __init__(self, engine: Engine, *, max_batch: int = 128):
        self._engine = engine
        self._max_batch = max_batch
        self._pending: collections.deque = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._connection: Connection | None = None
        self._closed = False
        self.batches = 0
        self.operations = 0

    async def run(self, op: WriteOp[T]) -> T:
        """Run `op` in a committed transaction and return its result (raises what it raised)."""
        if self._closed:
            raise WriterClosed("the store is shutting down")
        if self._task is None or self._task.done():  # first use, or the drain died of a bug
            self._wakeup = asyncio.Event()
            self._task = asyncio.create_task(self._drain(), name="store-writer")
        future = asyncio.get_running_loop().create_future()
        self._pending.append((op, future))
        self._wakeup.set()  # type: ignore[union-attr]
        return await future

    async def aclose(self) -> None:
        """Finish what is queued, then stop. Idempotent."""
        self._closed = True
        if self._task is not None:
            self._wakeup.set()  # type: ignore[union-attr]
            await self._task
            self._task = None
        if self._connection is not None:
            await asyncio.to_thread(self._connection.close)
            self._connection = None

    def close(self, timeout_s: float = 10.0) -> None:
        if self._connection is not None and self._task is None:
            self._connection.close()
            self._connection = None

    async def _drain(self) -> None:
        while True:
            await self._wakeup.wait()  # type: ignore[union-attr]
            self._wakeup.clear()  # type: ignore[union-attr]
            while self._pending:
                batch = [self._pending.popleft() for _ in range(min(len(self._pending), self._max_batch))]
                batch = [(op, fut) for op, fut in batch if not fut.cancelled()]
                if batch:
                    await self._run_batch(batch)
            if self._closed:
                return

    async def _run_batch(self, batch: list) -> None:
        try:
            results = await self._transaction([op for op, _ in batch])
        except Exception as exc:  # one operation failed, or the database did: isolate below
            if len(batch) == 1:
                _deliver(batch[0][1], exception=exc)
                return
            for op, fut in batch:
                try:
                    _deliver(fut, result=(await self._transaction([op]))[0])
                except Exception as single:
                    _deliver(fut, exception=single)
            return
        self.batches += 1
        self.operations += len(batch)
        for (_, fut), result in zip(batch, results):
            _deliver(fut, result=result)

    async def _transaction(self, ops: list) -> list:
        if self._connection is None or self._connection.invalidated:
            self._connection = await asyncio.to_thread(self._engine.connect)
        connection = self._connection
        transaction = await asyncio.to_thread(connection.begin)  # BEGIN IMMEDIATE may wait for the lock
        try:
            results = [op(connection) for op in ops]
        except BaseException:
            await asyncio.to_thread(transaction.rollback)
            raise
        try:
            await asyncio.to_thread(transaction.commit)  # the fsync: the loop serves meanwhile
        except BaseException:
            self._connection = None
            await asyncio.to_thread(connection.close)
            raise
        return results


def _deliver(future: asyncio.Future, *, result: Any = None, exception: BaseException | None = None) -> None:
    if future.done():
        return
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(result)
