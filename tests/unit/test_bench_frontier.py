"""scripts/bench_frontier.py's grid: gates given as fractions of the batch, and the per-point
figures read from a bench_fidelity report (the child process is stood in for)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_frontier  # noqa: E402


def test_gates_are_fractions_of_the_batch_or_none():
    assert [bench_frontier.gate_samples(bench_frontier.parse_gate(g), 64) for g in ("0", "1/8", "0.25", "none")] \
        == [0, 8, 16, None]
    assert bench_frontier.gate_samples(Fraction(1, 16), 16) == 1
    with pytest.raises(Exception):
        bench_frontier.parse_gate("-1/8")


def test_a_point_reads_the_gap_the_rate_and_the_delays_from_its_run(monkeypatch):
    report = {"errors": [], "settings": {"batch64": {
        "config": {"steps": 60},
        "swarm": {"train_tokens_per_s": 9000, "accounting": {"completed": 3840, "dropped": 0, "unaccounted": 0},
                  "per_stage": {"0": {"replicas": [{"staleness": {"delayed_share": 0.18}}]}}},
        "gaps": {"held_out": 0.0056, "staleness_alone_held_out": 0.0056, "held_out_vs_replay": 0.0},
        "reference": {"order_noise": {"relative_std": 0.003}}}}}
    seen = []

    def fake_run(command, **kwargs):
        seen.append(command)
        with open(command[command.index("--out") + 1], "w") as handle:
            json.dump(report, handle)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(bench_frontier.subprocess, "run", fake_run)
    point = bench_frontier.run_point(64, None, "workers", 8, None, 3)
    assert "--no-forward-gate" in seen[0] and seen[0][seen[0].index("--routing") + 1] == "workers"
    assert point["tokens_per_s"] == 9000 and point["held_out_gap"] == 0.0056
    assert point["delayed_share_head"] == 0.18 and point["accounting"]["unaccounted"] == 0
    assert point["errors"] == []
