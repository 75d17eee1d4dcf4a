"""How a role's background tasks wake up: on a period, on news from another part, or on stop.

Every such task used to paste the same loop (`while not stop.is_set(): ...; await
asyncio.wait_for(stop.wait(), period)`), and the ones that also had to react to news polled for
it every 0.1-0.5 s. Here is the loop once (`every`), the wait it is built on (`wait_any`), and
the news (`Signal`): a part that has something to tell fires a signal, from the event loop or
from the compute thread, and each task that cares wakes at once instead of asking "has it
happened yet?" on a timer.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from typing import Awaitable, Callable, Optional, Union

logger = logging.getLogger(__name__)

Period = Union[float, Callable[[], Optional[float]]]
"""Seconds to the next call: a constant, or a function of the moment (None: only on `wake`)."""


async def wait_any(*events: asyncio.Event, timeout: Optional[float] = None) -> bool:
    """Wait until one of `events` is set or `timeout` passes; True if an event was set."""
    if any(event.is_set() for event in events):
        return True
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return bool(done)


async def every(period_s: Period, fn: Callable[[], Union[Awaitable[None], None]], stop: asyncio.Event, *,
                name: str, wake: Optional[asyncio.Event] = None, min_interval_s: float = 0.0,
                delay_first: bool = False) -> None:
    """Call `fn` now (or after one period with `delay_first`), then again each time `period_s`
    passes or `wake` is set, until `stop` is set.

    `wake` is cleared right before each call, so news that arrives during a call triggers the
    next one. Calls start at least `min_interval_s` apart, which bounds the rate at which a
    chatty `wake` can drive them. An exception from `fn` is logged with `name` and the loop goes
    on: one failed announcement or refresh must not end the task.
    """
    events = (stop,) if wake is None else (stop, wake)
    if delay_first:
        await wait_any(*events, timeout=_seconds(period_s))
    while not stop.is_set():
        started = time.monotonic()
        if wake is not None:
            wake.clear()
        try:
            result = fn()
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s failed", name)
        _raise_if_cancel_swallowed()
        await wait_any(*events, timeout=_seconds(period_s))
        rest = min_interval_s - (time.monotonic() - started)
        if rest > 0 and not stop.is_set():
            await wait_any(stop, timeout=rest)


def _raise_if_cancel_swallowed() -> None:
    """End the loop if this task was cancelled and something inside `fn` swallowed it: Python
    3.11's `asyncio.wait_for` returns its result when a cancellation lands as it completes, and a
    loop that went on would keep a leaving node waiting for it (seen: a 60 s drain)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError()


def _seconds(period_s: Period) -> Optional[float]:
    value = period_s() if callable(period_s) else period_s
    return None if value is None else max(0.0, value)


class Signal:
    """News one part of a role gives the others ("a step was taken", "the compute thread died").

    Any thread may `fire` it; each listener is an asyncio.Event of its own, set on its own loop,
    so one task clearing its event never hides the news from another. Firing with no listener
    does nothing: a signal carries no state, the listener reads what changed from its source.
    """

    def __init__(self) -> None:
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._lock = threading.Lock()

    def listen(self) -> asyncio.Event:
        """A new event that this signal sets; call on the loop that will wait on it."""
        event = asyncio.Event()
        with self._lock:
            self._listeners.append((asyncio.get_running_loop(), event))
        return event

    def fire(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for loop, event in listeners:
            try:
                if _running_loop() is loop:
                    event.set()
                else:
                    loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed: its listener is gone with it
                pass


def _running_loop() -> Optional[asyncio.AbstractEventLoop]:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
