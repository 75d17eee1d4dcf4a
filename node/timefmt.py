"""Times as people read them: "valid until 20:41 UTC, in 30 min", "giving up in 4 min 52 s".

Logs show wall-clock instants in UTC (a node and its operator are often in different time zones;
the authorizer's records are in UTC too) and spans as rounded durations, never raw Unix times.
"""

from __future__ import annotations

import time
from typing import Optional


def duration(seconds: float) -> str:
    """A span, rounded to what matters: '0.4 s', '12 s', '4 min 52 s', '30 min', '2 h 5 min', '3 d 4 h'."""
    seconds = max(0.0, float(seconds))
    if seconds < 10:
        text = f"{seconds:.1f}".rstrip("0").rstrip(".")
        return f"{text} s"
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 10:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    minutes = int(round(whole / 60))
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def clock(ts: float) -> str:
    """The instant `ts` (Unix seconds) in UTC: '20:41 UTC' today, else '2025-06-02 20:41 UTC'."""
    moment = time.gmtime(ts)
    if time.strftime("%Y-%m-%d", moment) == time.strftime("%Y-%m-%d", time.gmtime()):
        return time.strftime("%H:%M UTC", moment)
    return time.strftime("%Y-%m-%d %H:%M UTC", moment)


def until(ts: float, now: Optional[float] = None) -> str:
    """'until 20:41 UTC, in 30 min' (or '..., 3 min ago' once past)."""
    left = ts - (time.time() if now is None else now)
    relative = f"in {duration(left)}" if left >= 0 else f"{duration(-left)} ago"
    return f"until {clock(ts)}, {relative}"
