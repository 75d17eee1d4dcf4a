"""The live terminal views draw what their snapshot says and survive a snapshot that fails."""

from __future__ import annotations

import io

from rich.console import Console

from node.live_display import DemoLiveDisplay, TrainerLiveDisplay
from tests.support.polling import poll_until


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=100, color_system=None), out


def test_trainer_view_draws_its_snapshot_and_keeps_the_last_frame_on_a_failed_read():
    reads = []

    def snapshot() -> dict:
        reads.append(1)
        if len(reads) == 3:
            raise RuntimeError("dictionary changed size during iteration")
        return {"state": "training", "samples_completed": 100 * len(reads), "samples_dropped": 1,
                "samples_in_flight": 3, "tokens": 6400 * len(reads), "loss": 4.5678, "lanes": 4,
                "workers_per_stage": [1, 0, 2]}

    console, out = _console()
    view = TrainerLiveDisplay(snapshot, console=console, refresh_per_second=20)
    view.start()
    poll_until(lambda: len(reads) >= 5, 30, "a few refreshes")
    view.stop()
    view.stop()  # idempotent
    text = out.getvalue()
    assert "loss" in text and "4.568" in text and "lanes busy" in text and "3/4" in text
    assert "0:1" in text and "1:0" in text and "2:2" in text and "training" in text


def test_demo_view_shows_steps_of_the_run():
    console, out = _console()
    view = DemoLiveDisplay(60, console=console, refresh_per_second=20)
    view.start()
    view.update(step=12, loss=3.25, tokens_per_s=2821.4, workers=[1, 1, 1])
    poll_until(lambda: "12/60" in out.getvalue(), 30, "the demo view to show the step")
    view.update(step=13, loss=None, tokens_per_s=None, workers=[1, 1, 1])
    poll_until(lambda: "13/60" in out.getvalue(), 30, "the demo view to show the next step")
    view.stop()
    last = out.getvalue().rsplit("13/60", 1)[1]
    assert "3.250" in last and "2,821" in last, "numbers not read this time stay on screen"


def test_trainer_snapshot_reads_a_trainers_accounting():
    from types import SimpleNamespace

    from node.live_display import trainer_snapshot
    from roles.trainer.accounting import SampleAccounting
    from roles.trainer.role import TrainerState

    accounting = SampleAccounting()
    for _ in range(3):
        accounting.start()
    accounting.complete(4.25, 64, 1)
    accounting.drop("no_workers")
    role = SimpleNamespace(accounting=accounting, state=TrainerState.TRAINING, config=SimpleNamespace(lanes=4),
                           discovery=SimpleNamespace(workers_per_stage=lambda: [1, 2]))
    assert trainer_snapshot(role) == {"state": "training", "samples_completed": 1, "samples_dropped": 1,
                                      "samples_in_flight": 1, "tokens": 64, "loss": 4.25, "lanes": 4,
                                      "workers_per_stage": [1, 2]}
