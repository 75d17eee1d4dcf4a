"""Batch coalescing: queue choice, batch limits, grouping, delivery and shutdown [report 3.3.1.3]."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import AgoraError
from roles.worker.serving.queues import (
    BatchResultMismatch,
    QueueClosed,
    QueueFull,
    Task,
    TaskKind,
    TaskQueues,
    run_batch,
)
from tests.support.polling import poll_until

F, B = TaskKind.FORWARD, TaskKind.BACKWARD


def wait_until_parked(q: TaskQueues) -> None:
    """Wait until a consumer is blocked inside `q.next_batch` (a waiter on its condition), so
    what the test does next has to wake it. `_waiters` is CPython's threading.Condition's own."""
    poll_until(lambda: q._cond._waiters, 5, "a consumer blocked in next_batch", period_s=0.005)


class Recorder:
    """Collects every on_done call, keyed by payload, and notices double deliveries."""

    def __init__(self):
        self.lock = threading.Lock()
        self.done: dict[object, tuple[object, BaseException | None]] = {}
        self.duplicates: list[object] = []

    def task(self, kind, payload, *, at=None, group=None) -> Task:
        def on_done(result, exc, payload=payload):
            with self.lock:
                if payload in self.done:
                    self.duplicates.append(payload)
                self.done[payload] = (result, exc)

        if at is None:
            return Task(kind=kind, payload=payload, on_done=on_done, group_key=group)
        return Task(kind=kind, payload=payload, on_done=on_done, enqueued_at=at, group_key=group)


def payloads(batch):
    return [t.payload for t in batch]


def test_serves_queue_with_oldest_head():
    rec, q = Recorder(), TaskQueues(max_batch=8)
    q.submit(rec.task(F, "f1", at=10.0))
    q.submit(rec.task(B, "b1", at=5.0))
    q.submit(rec.task(F, "f2", at=11.0))
    q.submit(rec.task(B, "b2", at=12.0))
    assert payloads(q.next_batch(0)) == ["b1", "b2"]
    assert payloads(q.next_batch(0)) == ["f1", "f2"]

    q.submit(rec.task(B, "b3", at=20.0))
    q.submit(rec.task(F, "f3", at=21.0))
    assert payloads(q.next_batch(0)) == ["b3"]
    assert payloads(q.next_batch(0)) == ["f3"]


def test_equal_timestamps_break_ties_by_arrival():
    rec, q = Recorder(), TaskQueues(max_batch=8)
    q.submit(rec.task(B, "b", at=1.0))
    q.submit(rec.task(F, "f", at=1.0))
    assert payloads(q.next_batch(0)) == ["b"]


def test_never_exceeds_max_batch_and_max_batch_can_shrink():
    rec, q = Recorder(), TaskQueues(max_batch=3)
    for i in range(8):
        q.submit(rec.task(F, i))
    assert payloads(q.next_batch(0)) == [0, 1, 2]
    q.max_batch = 2
    assert payloads(q.next_batch(0)) == [3, 4]
    assert payloads(q.next_batch(0)) == [5, 6]
    assert payloads(q.next_batch(0)) == [7]
    stats = q.stats
    assert stats.total_batches == 4 and stats.total_tasks == 8
    assert stats.batch_size_counts == {3: 1, 2: 2, 1: 1}
    assert stats.mean_batch_size == 2.0
    with pytest.raises(ValueError):
        q.max_batch = 0


def test_only_same_group_key_merged_and_others_keep_their_place():
    rec, q = Recorder(), TaskQueues(max_batch=8)
    for i, group in enumerate([128, 64, 128, 64, 128]):
        q.submit(rec.task(F, i, group=group))
    assert payloads(q.next_batch(0)) == [0, 2, 4]
    assert payloads(q.next_batch(0)) == [1, 3]
    assert q.pending() == {F: 0, B: 0}


def test_each_requester_gets_its_own_result():
    rec, q = Recorder(), TaskQueues(max_batch=16)
    for i in range(10):
        q.submit(rec.task(F, i))
    run_batch(q.next_batch(0), lambda xs: [x * 100 for x in xs])
    assert rec.done == {i: (i * 100, None) for i in range(10)}


def test_compute_error_reaches_every_task_and_next_batch_still_works():
    rec, q = Recorder(), TaskQueues(max_batch=3)
    for i in range(5):
        q.submit(rec.task(B, i))
    boom = RuntimeError("boom")

    def failing(xs):
        raise boom

    run_batch(q.next_batch(0), failing)
    assert all(rec.done[i] == (None, boom) for i in range(3))
    run_batch(q.next_batch(0), lambda xs: [-x for x in xs])
    assert rec.done[3] == (-3, None) and rec.done[4] == (-4, None)
    assert not rec.duplicates


def test_wrong_result_count_fails_every_task():
    rec, q = Recorder(), TaskQueues(max_batch=4)
    for i in range(3):
        q.submit(rec.task(F, i))
    run_batch(q.next_batch(0), lambda xs: xs[:-1])
    for i in range(3):
        result, exc = rec.done[i]
        assert result is None and isinstance(exc, BatchResultMismatch)


def test_failing_callback_does_not_starve_the_others():
    rec = Recorder()

    def bad(result, exc):
        raise ValueError("callback bug")

    tasks = [Task(kind=F, payload=0, on_done=bad), rec.task(F, 1)]
    run_batch(tasks, lambda xs: xs)
    assert rec.done == {1: (1, None)}


def test_close_returns_pending_and_rejects_later_submits():
    rec, q = Recorder(), TaskQueues(max_batch=4)
    q.submit(rec.task(F, "f", at=2.0))
    q.submit(rec.task(B, "b", at=1.0))
    left = q.close()
    assert sorted(payloads(left)) == ["b", "f"]
    assert q.pending() == {F: 0, B: 0}
    with pytest.raises(QueueClosed) as info:
        q.submit(rec.task(F, "late"))
    assert isinstance(info.value, AgoraError)
    assert q.next_batch(0) == [] and q.next_batch(None) == []


def test_close_wakes_a_blocked_consumer():
    q = TaskQueues(max_batch=4)
    out = []
    consumer = threading.Thread(target=lambda: out.append(q.next_batch()))
    consumer.start()
    wait_until_parked(q)
    q.close()
    consumer.join(timeout=5)
    assert not consumer.is_alive() and out == [[]]


def test_queue_full():
    rec, q = Recorder(), TaskQueues(max_batch=4, max_pending=3)
    for i in range(3):
        q.submit(rec.task(F if i % 2 else B, i))
    with pytest.raises(QueueFull):
        q.submit(rec.task(F, 99))
    q.next_batch(0)
    q.submit(rec.task(F, 99))


def test_next_batch_times_out_when_idle():
    q = TaskQueues(max_batch=4)
    start = time.monotonic()
    assert q.next_batch(timeout=0.05) == []
    assert time.monotonic() - start >= 0.04


def test_consumer_wakes_on_submit():
    rec, q = Recorder(), TaskQueues(max_batch=4)
    producer = threading.Thread(target=lambda: (wait_until_parked(q), q.submit(rec.task(F, "x"))))
    producer.start()
    assert payloads(q.next_batch(timeout=5)) == ["x"]
    producer.join(timeout=5)


def test_concurrent_producers_every_task_answered_once():
    producers, per_producer = 4, 500
    rec, q = Recorder(), TaskQueues(max_batch=7, max_pending=producers * per_producer)
    total = producers * per_producer
    sizes, problems = [], []

    def consume():
        answered = 0
        while answered < total:
            batch = q.next_batch(timeout=5)
            if not batch:
                problems.append(f"consumer starved after {answered} tasks")
                return
            if len({t.kind for t in batch}) != 1 or len(batch) > 7:
                problems.append(f"bad batch {[(t.kind, t.payload) for t in batch]}")
            sizes.append(len(batch))
            run_batch(batch, lambda xs: [("ok", x) for x in xs])
            answered += len(batch)

    def produce(p):
        for i in range(per_producer):
            q.submit(rec.task(F if i % 3 else B, (p, i)))

    consumer = threading.Thread(target=consume)
    consumer.start()
    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    consumer.join(timeout=10)
    assert not consumer.is_alive() and not problems
    assert not rec.duplicates
    assert rec.done == {(p, i): (("ok", (p, i)), None) for p in range(producers) for i in range(per_producer)}
    assert sum(sizes) == total == q.stats.total_tasks


@settings(max_examples=200, deadline=None)
@given(
    max_batch=st.integers(1, 6),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("submit"), st.sampled_from(list(TaskKind)), st.sampled_from([None, 1, 2])),
            st.tuples(st.just("take")),
        ),
        max_size=60,
    ),
)
def test_batches_preserve_fifo_per_queue_and_group(max_batch, ops):
    rec, q = Recorder(), TaskQueues(max_batch=max_batch)
    submitted: dict[tuple, list[int]] = {}
    taken: dict[tuple, list[int]] = {}
    n = 0

    def take():
        batch = q.next_batch(0)
        if batch:
            assert len(batch) <= max_batch
            assert len({(t.kind, t.group_key) for t in batch}) == 1
            for t in batch:
                taken.setdefault((t.kind, t.group_key), []).append(t.payload)
        return batch

    for op in ops:
        if op[0] == "submit":
            _, kind, group = op
            q.submit(rec.task(kind, n, at=float(n), group=group))
            submitted.setdefault((kind, group), []).append(n)
            n += 1
        else:
            take()
    while take():
        pass
    assert taken == submitted
    assert q.stats.total_tasks == n


@settings(max_examples=100, deadline=None)
@given(max_batch=st.integers(1, 6), kinds=st.lists(st.sampled_from(list(TaskKind)), max_size=40))
def test_ungrouped_batches_match_oldest_head_model(max_batch, kinds):
    rec, q = Recorder(), TaskQueues(max_batch=max_batch)
    for i, kind in enumerate(kinds):
        q.submit(rec.task(kind, i, at=float(i)))
    model = {k: [i for i, kk in enumerate(kinds) if kk == k] for k in TaskKind}
    while batch := q.next_batch(0):
        kind = min((k for k in TaskKind if model[k]), key=lambda k: model[k][0])
        assert batch[0].kind == kind
        assert payloads(batch) == model[kind][:max_batch]
        del model[kind][:max_batch]
    assert model == {k: [] for k in TaskKind}


def test_a_retry_replaces_its_sample_s_request_that_still_waits():
    """A caller that timed out and retried does not wait for the first request any more: the worker
    drops it unrun and answers it Superseded; requests of other samples or callers stay."""
    from roles.worker.serving.queues import Superseded

    queues = TaskQueues(max_batch=8)
    answers = []

    def task(key, name):
        return Task(kind=TaskKind.FORWARD, payload=name, on_done=lambda r, e: answers.append((name, e)),
                    supersede_key=key)

    queues.submit(task(("t1", "s1"), "first"))
    queues.submit(task(("t2", "s1"), "other caller"))
    queues.submit(task(None, "no key"))
    queues.submit(task(("t1", "s1"), "retry"))
    assert [(n, type(e)) for n, e in answers] == [("first", Superseded)]
    assert [t.payload for t in queues.next_batch(timeout=0)] == ["other caller", "no key", "retry"]
    assert queues.superseded == 1


def test_a_task_whose_caller_left_is_discarded_unrun_and_a_taken_one_is_not():
    rec, q = Recorder(), TaskQueues(max_batch=8)
    left, stays = rec.task(F, "left", at=1.0), rec.task(F, "stays", at=2.0)
    q.submit(left)
    q.submit(stays)
    assert q.discard(left)
    assert payloads(q.next_batch(0)) == ["stays"]
    assert not q.discard(stays), "the consumer already took it"
    assert rec.done == {}, "nobody waits for a discarded task: no answer"
