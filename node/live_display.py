"""Live terminal views (rich): the trainer's progress and the demo's, redrawn in place.

Used only when stdout is a terminal; a pipe or a file gets the plain lines it always did, which
scripts and tests parse. A view reads its numbers through a callable on its own refresh thread,
so nothing on the training path waits for the terminal; a read that fails (a dict resized under
it) keeps the last good frame.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

RATE_WINDOW_S = 10.0
"""Tokens/s is measured over this much recent time: per refresh it jumps with every batch."""


class _Rate:
    """A counter's rate over the last RATE_WINDOW_S seconds."""

    def __init__(self):
        self.samples: collections.deque[tuple[float, float]] = collections.deque()

    def update(self, value: float, now: float) -> Optional[float]:
        self.samples.append((now, value))
        while len(self.samples) > 2 and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()
        (t0, v0), (t1, v1) = self.samples[0], self.samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 - t0 >= 1.0 and v1 >= v0 else None


def _fmt(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


class _LiveView:
    """A rich Live on stdout whose frame `render()` builds on each refresh."""

    def __init__(self, *, console=None, refresh_per_second: float = 2.0):
        self.console = console
        self.refresh_per_second = refresh_per_second
        self._live = None
        self._last = None
        self._lock = threading.Lock()

    def frame(self):
        raise NotImplementedError

    def _safe_frame(self):
        with self._lock:
            try:
                self._last = self.frame()
            except Exception:  # noqa: BLE001 - a racing read; the next refresh will do
                if self._last is None:
                    from rich.text import Text

                    self._last = Text("starting…")
            return self._last

    def start(self) -> None:
        from rich.console import Console
        from rich.live import Live

        if self._live is not None:
            return
        # Logs go to stderr through handlers made before us: leave both streams alone.
        self._live = Live(get_renderable=self._safe_frame, console=self.console or Console(),
                          refresh_per_second=self.refresh_per_second, redirect_stdout=False, redirect_stderr=False)
        self._live.start()

    def stop(self) -> None:
        """Draw the last frame and stop; idempotent."""
        live, self._live = self._live, None
        if live is not None:
            live.stop()


class TrainerLiveDisplay(_LiveView):
    """The trainer's loss, tokens/s, samples, lanes busy and workers per stage.

    `snapshot()` returns a dict with any of: state, samples_completed, samples_dropped,
    samples_in_flight, tokens, loss, lanes, workers_per_stage (see `trainer_snapshot`)."""

    def __init__(self, snapshot: Callable[[], dict], *, console=None, refresh_per_second: float = 2.0):
        super().__init__(console=console, refresh_per_second=refresh_per_second)
        self.snapshot = snapshot
        self.rate = _Rate()
        self.started = time.monotonic()

    def frame(self):
        from rich.table import Table

        s = self.snapshot()
        now = time.monotonic()
        tokens_per_s = self.rate.update(float(s.get("tokens") or 0), now)
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", justify="right")
        grid.add_column()
        loss = s.get("loss")
        lanes = s.get("lanes")
        busy = s.get("samples_in_flight")
        grid.add_row("trainer", f"{s.get('state', '-')}  {now - self.started:,.0f}s")
        grid.add_row("loss", "-" if loss is None else f"{loss:.3f}")
        grid.add_row("tokens/s", _fmt(tokens_per_s))
        grid.add_row("samples", f"{_fmt(s.get('samples_completed'))} completed, {_fmt(s.get('samples_dropped'))} dropped")
        grid.add_row("tokens", _fmt(s.get("tokens")))
        grid.add_row("lanes busy", "-" if busy is None else f"{min(busy, lanes or busy)}/{_fmt(lanes)}")
        workers = s.get("workers_per_stage")
        grid.add_row("workers per stage", "-" if workers is None else "  ".join(
            f"[{'red' if n == 0 else 'green'}]{i}:{n}[/]" for i, n in enumerate(workers)))
        return grid


def trainer_snapshot(role) -> dict:
    """What TrainerLiveDisplay shows, read from a roles.trainer TrainerRole (read only)."""
    accounting = role.accounting
    return {
        "state": getattr(role.state, "value", str(role.state)),
        "samples_completed": accounting.completed,
        "samples_dropped": accounting.dropped,
        "samples_in_flight": accounting.in_flight,
        "tokens": accounting.tokens,
        "loss": accounting.recent_loss,
        "lanes": role.config.lanes,
        "workers_per_stage": list(role.discovery.workers_per_stage()),
    }


class DemoLiveDisplay(_LiveView):
    """The demo's step out of its steps, loss, tokens/s and workers per stage; `update()` gives
    it the numbers the demo read from the DHT."""

    def __init__(self, steps: int, *, console=None, refresh_per_second: float = 4.0):
        super().__init__(console=console, refresh_per_second=refresh_per_second)
        self.steps = steps
        self.values: dict = {}
        self.started = time.monotonic()

    def update(self, **values) -> None:
        """New numbers; a None keeps the one shown before (a record not read this time)."""
        with self._lock:
            self.values.update({k: v for k, v in values.items() if v is not None})

    def frame(self):
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        v = self.values
        step = v.get("step") or 0
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", justify="right")
        grid.add_column()
        grid.add_row("step", f"{step}/{self.steps}")
        grid.add_row("", ProgressBar(total=max(self.steps, 1), completed=min(step, self.steps), width=40))
        loss = v.get("loss")
        grid.add_row("loss", "-" if loss is None else f"{loss:.3f}")
        grid.add_row("tokens/s", _fmt(v.get("tokens_per_s")))
        workers = v.get("workers")
        grid.add_row("workers per stage", "-" if workers is None else "  ".join(
            f"[{'red' if n == 0 else 'green'}]{i}:{n}[/]" for i, n in enumerate(workers)))
        grid.add_row("elapsed", f"{time.monotonic() - self.started:,.0f}s")
        return grid


def start_trainer_display(role) -> Optional[TrainerLiveDisplay]:
    """The trainer's live view, started, when stdout is a terminal; None otherwise (plain logs)."""
    import sys

    if not sys.stdout.isatty():
        return None
    display = TrainerLiveDisplay(lambda: trainer_snapshot(role))
    display.start()
    return display
