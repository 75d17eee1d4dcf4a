"""`scripts/bench_fidelity.py --quick --data text:MB`: the fidelity benchmark's quick run on real
text the benchmark makes and prepares itself (documentation on this machine, a trained BPE), with
real nodes: the swarm trains as one process does on the same samples, and trainer 0's in-run
held-out curve comes with its standard error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.support.processes import processes_with_marker

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(420)
def test_the_quick_run_on_real_text_matches_one_process_and_reports_its_curve(tmp_path):
    marker = uuid.uuid4().hex
    out = tmp_path / "fidelity.json"
    env = {**os.environ, "AGORA_TEST_MARKER": marker, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "scripts/bench_fidelity.py", "--quick", "--setting", "demo",
                             "--data", "text:0.5", "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    demo = report["settings"]["demo"]
    assert report["errors"] == [], report["errors"]
    data = demo["config"]["data"]
    assert data["kind"] == "prepared" and data["tokenizer_trained"] and data["vocab_size"] == 4096
    assert demo["config"]["vocab_size"] == 4096
    assert abs(demo["gaps"]["held_out"]) <= 0.03, demo["gaps"]
    curve = demo["swarm"]["evaluation"]
    # The first evaluation is at the first step the trainer sees: 0 alone, 1 or 2 on a loaded machine
    # (the other trainer's samples can complete a step or two before this one reads the stage's
    # step); the curve must start in the run's first quarter (--quick: 20 steps).
    assert curve is not None and curve["curve"][0]["step"] <= 5 and len(curve["curve"]) >= 2, curve
    assert all(point["stderr"] is not None and point["stderr"] > 0 for point in curve["curve"])
    assert curve["curve"][-1]["held_out_loss"] < curve["curve"][0]["held_out_loss"]
    assert processes_with_marker(marker) == []
