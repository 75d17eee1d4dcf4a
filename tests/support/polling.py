"""The one way tests wait: poll a condition until it holds, never a fixed sleep."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def poll_until(condition: Callable[[], T], timeout_s: float, what: str = "condition", period_s: float = 0.05) -> T:
    """Call `condition` until it returns something truthy and return that; fail after `timeout_s`
    with `what` in the message."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(period_s)
