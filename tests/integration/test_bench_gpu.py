"""scripts/bench_gpu.py (issue 23) between GPU sessions: its dry run on the CPU starts the real
workers and trainers, measures the same keys it reports on a GPU, and leaves nothing running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.support.processes import processes_with_marker

pytestmark = pytest.mark.integration

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_gpu.py")


@pytest.mark.timeout(240)
def test_the_gpu_bench_dry_run_measures_a_real_swarm_and_the_reference(tmp_path):
    marker = uuid.uuid4().hex
    out = tmp_path / "gpu.json"
    result = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(out)], capture_output=True, text=True,
                            timeout=220, env={**os.environ, "AGORA_TEST_MARKER": marker})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == [] and report["cleanup"]["node_survivors"] == [], report
    assert report["swarm"]["tokens_per_s"] > 0 and report["centralized"]["tokens_per_s"] > 0
    assert report["swarm_vs_centralized"] > 0
    assert set(report["per_stage"]) == {"0", "1", "2"}
    assert all(stage["utilization"] > 0 for stage in report["per_stage"].values()), report["per_stage"]
    assert report["workers_mean_coalesced_batch"] >= 1
    assert report["mfu"]["flops_per_token"] > 0 and report["mfu"]["peak_tflops"] is None  # no known peak on a CPU
    assert report["aims"]["met"] is None  # a dry run claims nothing
    assert json.loads(result.stdout.strip().splitlines()[-1])["swarm_vs_centralized"] == report["swarm_vs_centralized"]
    assert processes_with_marker(marker) == []


@pytest.mark.timeout(60)
def test_without_cuda_the_gpu_bench_says_so_and_exits_0():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the bench would run for minutes")
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "no CUDA device" in report["skipped"]
