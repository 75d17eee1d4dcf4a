"""Training progress, each sample counted exactly once [report 3.6.2.3].

A trainer reports cumulative counters of its own process (samples completed, tokens) under
`{run}/trainers`, re-announced every few seconds, so the same report is read many times and a
report may be missed. The monitor keeps one cursor per trainer: the counters it has already
counted. A report newer than the cursor adds only the difference. Counters that went down mean a
new process under the same peer id (a restart): its counters start from zero, so all of them are
new. Cursors and the run's totals are written in one transaction
(authorizer.monitor.store), so a restarted monitor neither forgets nor repeats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from protocol.dht_schema import TrainerRecord


@dataclass
class Cursor:
    """One row of `monitor_trainer_cursors`."""

    peer_id: str
    process: int
    samples: int
    tokens: int
    report_time: float
    first_loss: Optional[float] = None


@dataclass
class Counted:
    samples: int = 0
    tokens: int = 0
    cursors: list[Cursor] = field(default_factory=list)


def _new_process(cursor: Cursor, report: TrainerRecord) -> bool:
    # Not the first loss: trainers report the mean of their first few losses, which moves while
    # those samples complete. A restart that overtook its old counters before the monitor saw it
    # is counted from the old counters (undercounted, never counted twice).
    return report.samples_completed < cursor.samples or report.tokens < cursor.tokens


def count_progress(cursors: dict[str, Cursor], reports: dict[str, TrainerRecord]) -> Counted:
    """The samples and tokens in `reports` not counted before; advances `cursors` in place and
    lists the cursors that moved."""
    counted = Counted()
    for peer, report in reports.items():
        cursor = cursors.get(peer)
        if cursor is not None and report.time <= cursor.report_time:
            continue  # this report, or an older one, was counted already
        if cursor is None or _new_process(cursor, report):
            samples, tokens = report.samples_completed, report.tokens
            process = 1 if cursor is None else cursor.process + 1
        else:
            samples, tokens = report.samples_completed - cursor.samples, report.tokens - cursor.tokens
            process = cursor.process
        cursor = cursors[peer] = Cursor(peer_id=peer, process=process, samples=report.samples_completed,
                                        tokens=report.tokens, report_time=report.time, first_loss=report.first_loss)
        counted.samples += samples
        counted.tokens += tokens
        counted.cursors.append(cursor)
    return counted


def run_loss(reports: dict[str, TrainerRecord], present: set[str]) -> Optional[float]:
    """The run's current loss: the mean of the present trainers' recent losses."""
    losses = [r.recent_loss if r.recent_loss is not None else r.last_loss
              for peer, r in reports.items() if peer in present]
    losses = [x for x in losses if x is not None and x == x]
    return sum(losses) / len(losses) if losses else None


def run_eval(reports: dict[str, TrainerRecord], present: set[str]
             ) -> tuple[Optional[float], Optional[int], Optional[float]]:
    """The run's latest held-out loss, its step and its standard error: from the present trainer
    that evaluated at the highest step (one trainer evaluates, roles/trainer/evaluation.py; a
    restarted one may briefly report beside its old record)."""
    found = [(r.eval_step, r.eval_loss, r.eval_stderr) for peer, r in reports.items()
             if peer in present and r.eval_step is not None and r.eval_loss is not None and math.isfinite(r.eval_loss)]
    if not found:
        return None, None, None
    step, loss, stderr = max(found, key=lambda f: (f[0], f[1]))
    return loss, step, stderr
