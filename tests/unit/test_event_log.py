"""Repeated events come out as one line per interval with counts by reason."""

from __future__ import annotations

import logging

from roles.event_log import EventAggregator


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _aggregator(caplog, clock, **kwargs):
    caplog.set_level(logging.INFO, logger="test.events")
    return EventAggregator(logging.getLogger("test.events"), "dropped", "sample", interval_s=10.0, clock=clock,
                           **kwargs)


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "test.events"]


def test_a_lone_event_is_logged_at_once_with_its_detail(caplog):
    events = _aggregator(caplog, Clock())
    events.count("timeout", "stage 1 worker abcd1234: no reply in 30 s", subject="3f2a-17")
    assert _lines(caplog) == ["dropped sample 3f2a-17: timeout (stage 1 worker abcd1234: no reply in 30 s)"]
    assert caplog.records[-1].levelno == logging.WARNING


def test_a_burst_becomes_one_line_per_interval_with_counts_by_reason(caplog):
    clock = Clock()
    events = _aggregator(caplog, clock)
    for i in range(109):
        clock.now += 0.05
        events.count("no_workers" if i % 9 else "timeout", f"detail {i}")
    events.flush_due()
    assert len(_lines(caplog)) == 1  # the first one; the interval has not passed yet
    clock.now += 10
    events.flush_due()
    lines = _lines(caplog)
    assert len(lines) == 2
    assert lines[1].startswith("dropped 108 samples in the last 15 s: 96 no_workers, 12 timeout (last: detail 108)")
    assert events.totals == {"no_workers": 96, "timeout": 13} and events.pending == 0
    events.flush_due()
    events.flush()
    assert len(_lines(caplog)) == 2  # nothing new to say


def test_counting_past_the_interval_logs_without_a_periodic_flush(caplog):
    clock = Clock()
    events = _aggregator(caplog, clock)
    for _ in range(3):
        events.count("timeout")
    clock.now += 11
    events.count("timeout")
    assert _lines(caplog) == ["dropped sample: timeout", "dropped 3 samples in the last 11 s: 3 timeout"]


def test_flush_at_shutdown_logs_what_is_pending(caplog):
    clock = Clock()
    events = _aggregator(caplog, clock)
    events.count("a")
    events.count("b")
    clock.now += 2.5
    events.flush()
    assert _lines(caplog)[-1] == "dropped 1 sample in the last 2.5 s: 1 b"

