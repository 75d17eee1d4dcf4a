"""roles/periodic.py: the one wake-up loop of every background task, and the signals that wake it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from roles.periodic import Signal, every, wait_any


class Calls:
    """Counts calls and lets a test wait (with a deadline) until there were `n` of them."""

    def __init__(self, fail_first: bool = False):
        self.times: list[float] = []
        self.fail_first = fail_first
        self.changed = asyncio.Event()

    def __call__(self) -> None:
        self.times.append(time.monotonic())
        self.changed.set()
        if self.fail_first and len(self.times) == 1:
            raise RuntimeError("boom")

    async def reach(self, n: int, timeout_s: float = 5.0) -> None:
        async def wait() -> None:
            while len(self.times) < n:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), timeout_s)


@pytest.mark.timeout(10)
def test_calls_now_then_every_period_until_stopped_and_survives_a_failure(caplog):
    async def scene():
        stop, calls = asyncio.Event(), Calls(fail_first=True)
        task = asyncio.create_task(every(0.05, calls, stop, name="ticker"))
        await calls.reach(3)
        stop.set()
        await asyncio.wait_for(task, 1.0)
        return calls

    with caplog.at_level(logging.ERROR, logger="roles.periodic"):
        calls = asyncio.run(scene())
    assert "ticker failed" in caplog.text, "the failure is logged with the task's name"
    assert len(calls.times) >= 3, "the loop went on after the failure"


@pytest.mark.timeout(10)
def test_wake_calls_at_once_and_min_interval_bounds_the_rate():
    async def scene():
        stop, wake, calls = asyncio.Event(), asyncio.Event(), Calls()
        task = asyncio.create_task(every(60.0, calls, stop, name="woken", wake=wake, min_interval_s=0.2))
        await calls.reach(1)
        wake.set()
        await calls.reach(2)
        wake.set()
        await calls.reach(3)
        stop.set()
        await asyncio.wait_for(task, 1.0)
        return calls

    times = asyncio.run(scene()).times
    assert times[2] - times[1] >= 0.2 - 1e-3, "woken calls are at least min_interval_s apart"


@pytest.mark.timeout(10)
def test_delay_first_and_a_period_of_none_wait_for_wake_or_stop():
    async def scene():
        stop, wake, calls = asyncio.Event(), asyncio.Event(), Calls()
        task = asyncio.create_task(every(lambda: None, calls, stop, name="on-wake-only", wake=wake, delay_first=True))
        assert not await wait_any(stop, timeout=0.1) and calls.times == [], "nothing before the first wake"
        wake.set()
        await calls.reach(1)
        stop.set()
        await asyncio.wait_for(task, 1.0)
        return calls

    assert len(asyncio.run(scene()).times) == 1


@pytest.mark.timeout(10)
def test_a_signal_fired_from_another_thread_wakes_every_listener():
    async def scene():
        signal = Signal()
        first, second = signal.listen(), signal.listen()
        threading.Thread(target=signal.fire).start()
        assert await wait_any(first, timeout=5.0) and await wait_any(second, timeout=5.0)
        first.clear()
        signal.fire()  # on the loop itself
        assert first.is_set() and second.is_set()

    asyncio.run(scene())
    Signal().fire()  # no listener: nothing happens


@pytest.mark.timeout(10)
def test_a_cancellation_swallowed_inside_the_call_still_ends_the_loop():
    """Python 3.11's wait_for can return its result when a cancellation lands as it completes;
    the loop must not go on (a leaving worker waited 60 s for such a loop)."""

    async def swallowing():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # what wait_for does when the inner result is ready as the cancel lands

    async def scenario():
        stop = asyncio.Event()
        task = asyncio.create_task(every(0.01, swallowing, stop, name="swallow"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)

    asyncio.run(scenario())
