"""`agora-node demo` end to end: the command a newcomer runs first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.support.processes import processes_with_marker

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_demo_trains_and_leaves_nothing_behind():
    marker = uuid.uuid4().hex  # inherited by every process the demo starts, however deep
    env = {**os.environ, "AGORA_TEST_MARKER": marker}
    result = subprocess.run([sys.executable, "-m", "node.cli", "demo", "--json", "--steps", "20"],
                            capture_output=True, text=True, timeout=220, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(summary) >= {"first_loss", "last_loss", "tokens_per_s", "samples_completed", "samples_dropped"}
    assert summary["last_loss"] < 0.8 * summary["first_loss"], summary
    assert summary["samples_completed"] + summary["samples_dropped"] == 20 * 16
    assert summary["tokens_per_s"] > 0
    # trainer 0 evaluated at the start (step 0) and once more at its last step
    assert summary["first_eval_step"] == 0 and summary["last_eval_step"] > 0, summary
    assert summary["last_eval_loss"] < summary["first_eval_loss"], summary
    assert 0 < summary["last_eval_stderr"] < 0.05 * summary["last_eval_loss"], summary  # 128 samples a point
    assert processes_with_marker(marker) == []
