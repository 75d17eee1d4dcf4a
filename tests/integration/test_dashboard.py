"""The dashboard and `agora-node status` against a live authenticated run: a real authorizer with
its in-process health monitor (a snapshot every 2 s), one worker on each stage of the tiny model
and a trainer that keeps training, all admitted through the authorizer. The dashboard is driven
in the system's headless Chromium: it shows every stage, draws the loss, lists the workers, opens a
worker's page with its telemetry, updates without a reload and writes nothing to the console.
Screenshots go to tests/.artifacts/ (and the test's tmp dir)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from authorizer.testing import AuthorizerProcess
from node.launcher import LocalSwarm
from tests.support.browser import attribute, chromium, console_errors, navigations, require_browser, text
from tests.support.polling import poll_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ARTIFACTS = Path(__file__).resolve().parent.parent / ".artifacts"


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, node_popen):
    """(authorizer, swarm, workers by stage, trainer, run config path), stopped and reaped after the module."""
    from protocol.run_config import dump_run_config, load_run_config

    tmp = tmp_path_factory.mktemp("dashboard-run")
    config = str(tmp / "run.yaml")
    dump_run_config(load_run_config("tiny", {"run_id": f"dash-{uuid.uuid4().hex[:6]}"}), config)
    authorizer = AuthorizerProcess(
        ["--run-config", config, "--data-dir", str(tmp / "authorizer"), "--port", "0", "--credential-ttl-s", "600",
         "--admin-token", "test-admin-token-0123456789", "--monitor-interval-s", "2"],
        log_path=str(tmp / "authorizer.log"), popen=node_popen)
    swarm = LocalSwarm(str(tmp / "swarm"), None, common_args=["--announce-period-s", "2"], popen=node_popen)
    try:
        authorizer.start()
        node_args = ["--authorizer", authorizer.url]
        workers = [swarm.start("worker", args=[*node_args, "--account-token", f"worker-{i}", "--max-batch", "8"],
                               wait_ready=False, name=f"worker-{i}") for i in range(3)]
        for worker in workers:
            swarm.wait_ready(worker, timeout_s=180)
        assert sorted(w.stage for w in workers) == [0, 1, 2], "the authorizer places one worker on each stage"
        trainer = swarm.start("trainer", args=[*node_args, "--account-token", "trainer-0", "--lanes", "2",
                                               "--max-samples", "1000000", "--discovery-period-s", "1"],
                              timeout_s=180)
        yield authorizer, swarm, {w.stage: w for w in workers}, trainer, config
    finally:
        swarm.stop_all(timeout_s=20)
        authorizer.stop()
        poll_until(lambda: not swarm.survivors(), 10, "every process of the swarm to exit")
        assert swarm.leaked_shared_memory() == []


def _monitor_sees_training(url: str):
    """The overview once the monitor has every worker, a loss and a few progress points."""
    try:
        overview = httpx.get(f"{url}/v1/monitor/overview", timeout=10).json()
        points = httpx.get(f"{url}/v1/monitor/progress", timeout=10).json()["points"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    replicas = [s.get("replicas") for s in overview.get("stages", [])]
    trained = (overview.get("training") or {}).get("loss") is not None
    losses = [p for p in points if p.get("loss") is not None]
    return overview if replicas == [1, 1, 1] and trained and len(losses) >= 2 else None


def _screenshot(driver, name: str, tmp_path) -> Path:
    """The whole page (the window grown to its height), to tests/.artifacts/ and the tmp dir."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    size = driver.get_window_size()
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(size["width"], min(max(size["height"], height + 140), 4000))
    try:
        assert driver.save_screenshot(str(path)), f"could not write {path}"
    finally:
        driver.set_window_size(size["width"], size["height"])
    shutil.copy(path, tmp_path / name)
    return path


def test_dashboard_shows_the_live_run_and_updates_without_reload(live_run, tmp_path):
    require_browser()
    authorizer, _, workers, _, _ = live_run
    url = authorizer.url
    poll_until(lambda: _monitor_sees_training(url), 300, "the monitor to see 3 workers and a loss", period_s=1)
    with chromium(str(tmp_path / "profile")) as driver:
        driver.get(f"{url}/dashboard")
        poll_until(lambda: len(driver.find_elements("css selector", "#stages-table tbody tr[data-key]")) == 3, 60,
                   "the stages table to show the 3 stages")
        assert [r.get_attribute("data-key") for r in
                driver.find_elements("css selector", "#stages-table tbody tr[data-key]")] == ["0", "1", "2"]
        poll_until(lambda: int(attribute(driver, "loss-chart", "data-points") or 0) >= 2, 60,
                   "the loss chart to draw its points")
        assert driver.find_elements("css selector", "#loss-chart path.line")
        nodes = poll_until(lambda: (t := text(driver, "nodes-table")) and all(
            w.peer_id in t for w in workers.values()) and t, 60, "the nodes table to list every worker")
        assert "worker" in nodes and "trainer" in nodes
        assert text(driver, "run-id").startswith("run dash-")
        assert text(driver, "total-loss") not in ("", "–")
        poll_until(lambda: text(driver, "total-eval-step").startswith("at step "), 90,
                   "the held-out loss card (the trainer evaluates from step 0)", period_s=0.5)
        poll_until(lambda: len(driver.find_elements("css selector", "#loss-chart path.line")) == 2, 60,
                   "the held-out series beside the training loss")

        origin = navigations(driver)
        samples, stamp = text(driver, "total-samples"), text(driver, "connection")
        poll_until(lambda: text(driver, "total-samples") != samples, 90,
                   "the samples total to change as the trainer trains, without a reload", period_s=0.5)
        assert text(driver, "connection") != stamp and "updated" in text(driver, "connection")
        assert navigations(driver) == origin, "the page updated itself; it was not reloaded"
        assert console_errors(driver) == []
        shot = _screenshot(driver, "dashboard.png", tmp_path)
        assert shot.stat().st_size > 10_000

        # a contributor finds their worker by its peer id
        mine = workers[1]
        driver.find_element("id", "find-peer").send_keys(mine.peer_id)
        driver.find_element("css selector", "#find-form button").click()
        poll_until(lambda: text(driver, "node-peer-id") == mine.peer_id, 60, "the worker's own page")
        assert driver.current_url.endswith(f"/dashboard/node/{mine.peer_id}")
        poll_until(lambda: text(driver, "node-role") == "worker" and text(driver, "node-stage") == "1", 60,
                   "the worker's role and stage")
        points = poll_until(lambda: int(attribute(driver, "node-step-chart", "data-points") or 0), 60,
                            "the worker's step chart")
        assert text(driver, "node-state") == "present" and text(driver, "node-phase") == "active"
        node_origin = navigations(driver)
        poll_until(lambda: int(attribute(driver, "node-step-chart", "data-points") or 0) > points, 90,
                   "the worker's telemetry to grow without a reload", period_s=0.5)
        assert navigations(driver) == node_origin
        assert text(driver, "node-throughput") not in ("", "–")
        assert console_errors(driver) == []
        _screenshot(driver, "dashboard-node.png", tmp_path)


def status(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "node.cli", "status", *args], capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def test_status_shows_the_monitors_overview(live_run):
    authorizer, _, _, _, _ = live_run
    poll_until(lambda: _monitor_sees_training(authorizer.url), 300, "the monitor to see the run", period_s=1)
    done = status("--authorizer", authorizer.url, "--json")
    assert done.returncode == 0, done.stderr
    overview = json.loads(done.stdout)
    assert overview["num_stages"] == 3 and [s["stage"] for s in overview["stages"]] == [0, 1, 2]
    assert all(s["replicas"] >= 1 and s["phases"]["active"] >= 1 for s in overview["stages"])
    assert overview["training"]["trainers"] >= 1 and overview["training"]["samples"] > 0
    overview = poll_until(lambda: (o := json.loads(status("--authorizer", authorizer.url, "--json").stdout))
                          ["training"]["eval_loss"] is not None and o, 90, "the monitor to see the held-out loss",
                          period_s=1)
    assert overview["training"]["eval_step"] >= 0

    plain = status("--authorizer", authorizer.url)
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()
    assert lines[0].startswith(f"run {overview['run_id']}") and "from the health monitor" in lines[0]
    assert [line.split()[0] for line in lines if line[:2] in ("0 ", "1 ", "2 ")] == ["0", "1", "2"]
    assert any(line.startswith("training: loss ") and "held-out " in line and "@ step" in line for line in lines)
    assert any(line.startswith("alerts:") or line.startswith(("WARNING", "CRITICAL")) for line in lines)
    assert "\x1b[" not in plain.stdout

    # --watch refreshes until Ctrl-C, which ends it with exit 0
    watch = subprocess.Popen([sys.executable, "-m", "node.cli", "status", "--authorizer", authorizer.url, "--watch",
                              "--interval-s", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
    try:
        seen = []
        for line in watch.stdout:
            seen.append(line)
            if sum(1 for s in seen if s.startswith("run ")) >= 2:
                break
        watch.send_signal(signal.SIGINT)
        assert watch.wait(30) == 0, watch.stderr.read()
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)


def test_status_through_an_authenticated_runs_dht_names_the_authorizer(live_run):
    _, _, workers, _, config = live_run
    done = status("--initial-peers", *workers[0].maddrs, "--config", config, "--timeout-s", "10")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "use agora-node status --authorizer URL" in done.stderr
