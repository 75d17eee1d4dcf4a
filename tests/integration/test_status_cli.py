"""`agora-node status` as users run it, against live agora-node processes: reading an open run's
DHT directly (--initial-peers), and the one-line failures. The same command against an
authorizer's health monitor: tests/integration/test_dashboard.py, which shares that swarm."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

TWO_STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]


def status(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`agora-node status ARGS` in its own process, as a user types it."""
    return subprocess.run([sys.executable, "-m", "node.cli", "status", *args], capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def test_status_reads_an_open_runs_dht(make_swarm, run_config_path):
    config = run_config_path(stages=TWO_STAGES, evaluation={"every_steps": 20, "samples": 16})
    swarm = make_swarm(config, common_args=["--announce-period-s", "2"])
    head = swarm.start("worker", stage=0, args=["--max-batch", "8"])
    swarm.start("worker", stage=1, args=["--max-batch", "8"])
    trainer = swarm.start("trainer", args=["--lanes", "2", "--max-samples", "100000", "--discovery-period-s", "1"])

    def overview():
        done = status("--initial-peers", *head.maddrs, "--config", config, "--json", "--timeout-s", "30")
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        trained = found["training"]["samples"] > 0 and found["training"]["trainers"] == 1
        trained = trained and found["training"]["eval_loss"] is not None  # trainer 0 evaluates from step 0
        return found if trained and [s["replicas"] for s in found["stages"]] == [1, 1] else None

    found = poll_until(overview, 240, "status to see both workers and the trainer's samples", period_s=1)
    assert found["source"] == "dht" and found["num_stages"] == 2 and found["nodes"]["present"] == 3
    assert all(s["phases"]["active"] == 1 for s in found["stages"])
    assert found["training"]["loss"] is not None and found["training"]["tokens"] > 0
    assert trainer.proc.poll() is None, "the trainer is still training while we read"

    plain = status("--initial-peers", *head.maddrs, "--config", config, "--timeout-s", "30")
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()
    assert lines[0].startswith("run ") and "from the DHT" in lines[0]
    assert any(line.startswith("training: loss ") and "held-out " in line and "@ step" in line for line in lines)
    assert [line.split()[:2] for line in lines if line[:2] in ("0 ", "1 ")] == [["0", "1/1"], ["1", "1/1"]]
    assert "\x1b[" not in plain.stdout, "no terminal codes when stdout is a pipe"


def test_unreachable_sources_are_one_line_with_exit_2(tmp_path):
    with socket.socket() as closed:  # bound, never listening: connections are refused while we hold it
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        done = status("--authorizer", f"http://127.0.0.1:{port}", "--timeout-s", "5")
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.strip().count("\n") == 0 and "cannot reach the authorizer" in done.stderr
        peer = "/ip4/127.0.0.1/tcp/{}/p2p/12D3KooWGzh6EurEXXXaMDEXKeg3RMzhA6oUzAz9Xk9A2Ve3Ds8A".format(port)
        done = status("--initial-peers", peer, "--config", "tiny", "--timeout-s", "5")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "could not reach any initial peer" in done.stderr
