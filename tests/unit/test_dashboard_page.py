"""The dashboard page against fixture JSON in the monitor API's shape, in a real headless Chromium:
it draws the run, escapes hostile peer ids, updates without a reload, says when the monitor is
off, and ships its own assets under a Content-Security-Policy. (The same page against a live swarm
and the real monitor: tests/integration/test_dashboard.py.)"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from authorizer.dashboard import ASSETS, CONTENT_SECURITY_POLICY, dashboard_router
from tests.support.browser import attribute, chromium, console_errors, navigations, require_browser, text
from tests.support.polling import poll_until

HOSTILE = '<img src=x onerror="window.pwned=1">'
HOSTILE_2 = '"><script>window.pwned=2</script>'
WORKERS = ["12D3KooWStageZeroWorkerAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "12D3KooWStageOneWorkerBBBBBBBBBBBBBBBBBBBBBBBBBBBB",
           "12D3KooWStageTwoWorkerCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"]


class FixtureMonitor:
    """The monitor API's contract with made-up numbers that move on every request."""

    def __init__(self):
        self.started = time.time() - 60
        self.samples = 0
        self.off = False
        self.lock = threading.Lock()

    def points(self, since: float | None) -> list[dict]:
        now = time.time()
        out = []
        for i in range(int(now - self.started) // 2):
            t = self.started + 2 * i
            if since is None or t > since:
                out.append({"t": t, "samples": 16 * i, "tokens": 16 * 64 * i, "loss": 5.5 * 0.97 ** i,
                            "tokens_per_s": 500.0 + 20 * (i % 7), "eval_loss": 5.6 * 0.97 ** (i // 4 * 4),
                            "eval_step": i // 4 * 4, "eval_stderr": 0.05})
        return out

    def node(self, peer_id: str, role: str, stage, phase) -> dict:
        return {"peer_id": peer_id, "role": role, "stage": stage, "state": "present", "phase": phase,
                "first_seen": self.started, "last_seen": time.time(), "throughput": 12.5, "step": self.samples // 16,
                "admitted": True}

    def nodes(self) -> list[dict]:
        return ([self.node(p, "worker", s, "active") for s, p in enumerate(WORKERS)]
                + [self.node(HOSTILE, "trainer", None, None), self.node(HOSTILE_2, "worker", 1, "weight_sync")])

    def overview(self) -> dict:
        with self.lock:
            self.samples += 16
        stages = [{"stage": s, "replicas": 1 + (s == 1), "min_replicas": 1,
                   "phases": {"active": 1, "weight_sync": int(s == 1), "optimizer_sync": 0, "leaving": 0},
                   "step": self.samples // 16, "throughput": 12.5,
                   "averaging": {"complete": 3, "partial": 1, "failed": 0, "skipped": 2, "success_rate": 0.75,
                                 "last_round_at": time.time() - 5}} for s in range(3)]
        return {"run_id": "fixture-run", "num_stages": 3, "updated_at": time.time(), "interval_s": 2.0, "stages": stages,
                "training": {"samples": self.samples, "tokens": self.samples * 64, "loss": 2.5, "tokens_per_s": 640.0,
                             "trainers": 1, "eval_loss": 2.7, "eval_step": 40, "eval_stderr": 0.031},
                "nodes": {"present": 5, "gone": 0, "admitted": 5, "queued": 1},
                "alerts": [{"id": 1, "kind": "stage_short", "severity": "critical", "subject": HOSTILE,
                            "message": "<b>stage 2</b> has fewer replicas than its minimum", "first_at": time.time(),
                            "last_at": time.time(), "resolved_at": None}]}


def fixture_app(monitor: FixtureMonitor) -> FastAPI:
    from authorizer.errors import AuthorizerError

    app = FastAPI()
    app.include_router(dashboard_router)

    @app.exception_handler(AuthorizerError)
    async def _error(_, exc: AuthorizerError) -> JSONResponse:  # as authorizer.app does
        return JSONResponse(exc.body(), status_code=exc.status)

    def guard():
        if monitor.off:
            return JSONResponse({"error": {"code": "monitor_off", "message": "the monitor is off"}}, status_code=503)
        return None

    @app.get("/v1/monitor/overview")
    def overview():
        return guard() or monitor.overview()

    @app.get("/v1/monitor/progress")
    def progress(since: float | None = None, limit: int = 500):
        return guard() or {"points": monitor.points(since)[:limit]}

    @app.get("/v1/monitor/nodes")
    def nodes():
        return guard() or {"nodes": monitor.nodes()}

    @app.get("/v1/monitor/nodes/{peer_id:path}")
    def node(peer_id: str):
        if guard():
            return guard()
        found = [n for n in monitor.nodes() if n["peer_id"] == peer_id]
        if not found:
            return JSONResponse({"error": {"code": "not_found", "message": "no such node"}}, status_code=404)
        now = time.time()
        history = [{"t": now - 40 + 4 * i, "phase": "weight_sync" if i < 3 else "active", "throughput": 10.0 + i,
                    "step": i, "samples": 16 * i, "rss_bytes": (300 + i) << 20, "rounds_complete": i // 2,
                    "rounds_failed": 0} for i in range(10)]
        rounds = [{"kind": "step", "round": 4, "status": "partial", "group_size": 1, "expected_group_size": 2,
                   "averaging_success": 0.5, "duration_s": 1.25, "finished_at": now - 3,
                   "failure_reason": HOSTILE_2}]
        return {"node": found[0], "history": history, "rounds": rounds}

    @app.get("/v1/run")
    def run():
        return {"run_id": "fixture-run", "stages": [{"index": s, "kind": "middle", "first_layer": s, "last_layer": s + 1,
                                                     "admitted": 1, "queued": int(s == 2), "target": 2, "capacity": 4,
                                                     "floor": {}} for s in range(3)],
                "trainers": {"admitted": 1, "queued": 0, "capacity": 8}}

    return app


@pytest.fixture
def served(tmp_path):
    """The fixture app on a socket we bound ourselves (127.0.0.1, port 0), served by uvicorn."""
    import uvicorn

    monitor = FixtureMonitor()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fixture_app(monitor), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    poll_until(lambda: server.started, 30, "the fixture server to start")
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", monitor
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_pages_and_assets_are_served_under_a_strict_policy():
    client = TestClient(fixture_app(FixtureMonitor()))
    for path in ("/dashboard", "/dashboard/node/12D3KooWabc", "/dashboard/node/%3Cscript%3E"):
        page = client.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert "default-src 'self'" in CONTENT_SECURITY_POLICY
        assert "http://" not in page.text and "https://" not in page.text, "the page loads nothing from elsewhere"
    for name in ASSETS:
        asset = client.get(f"/dashboard/assets/{name}")
        assert asset.status_code == 200 and asset.headers["x-content-type-options"] == "nosniff"
        assert "https://" not in asset.text.replace("http://www.w3.org/2000/svg", "")
    for bad in ("/dashboard/assets/index.html.bak", "/dashboard/assets/..%2Fdashboard.py", "/dashboard/assets/../app.py",
                "/dashboard/node/" + "x" * 200):
        assert client.get(bad).status_code == 404


def test_dashboard_draws_escapes_and_updates_in_chromium(served, tmp_path):
    require_browser()
    url, monitor = served
    with chromium(str(tmp_path / "profile")) as driver:
        driver.get(f"{url}/dashboard")
        poll_until(lambda: len(driver.find_elements("css selector", "#stages-table tbody tr[data-key]")) == 3, 30,
                   "the stages table to show 3 stages")
        poll_until(lambda: int(attribute(driver, "loss-chart", "data-points") or 0) > 5, 30,
                   "the loss chart to draw its points")
        assert len(driver.find_elements("css selector", "#loss-chart path.line")) == 2, "training and held-out loss"
        assert text(driver, "total-eval-loss") == "2.700" and text(driver, "total-eval-step") == "at step 40"
        assert text(driver, "total-eval-stderr") == "± 0.031"
        assert driver.find_elements("css selector", "#loss-chart path.band"), "the held-out loss's band"
        nodes_text = text(driver, "nodes-table")
        assert HOSTILE in nodes_text and HOSTILE_2 in nodes_text, "hostile peer ids are shown as text"
        assert HOSTILE in text(driver, "alerts")
        assert driver.execute_script("return window.pwned === undefined")
        assert not driver.find_elements("css selector", "#nodes-table img, #alerts img, #alerts b, script:not([src])")
        admissions = text(driver, "admissions-table")
        assert "stage 2" in admissions and "trainers" in admissions

        origin = navigations(driver)
        samples = text(driver, "total-samples")
        refreshes = int(driver.find_element("tag name", "body").get_attribute("data-refreshes"))
        poll_until(lambda: text(driver, "total-samples") != samples, 30,
                   "the samples total to change without a reload")
        assert int(driver.find_element("tag name", "body").get_attribute("data-refreshes")) > refreshes
        assert navigations(driver) == origin, "the page updated itself; it was not reloaded"
        assert "updated" in text(driver, "connection")
        assert console_errors(driver) == []

        # find my node: a tail of the id is enough
        driver.find_element("id", "find-peer").send_keys(WORKERS[1][-12:])
        driver.find_element("css selector", "#find-form button").click()
        poll_until(lambda: "/dashboard/node/" in driver.current_url, 30, "find-my-node to open the node page")
        poll_until(lambda: text(driver, "node-peer-id") == WORKERS[1], 30, "the node page")
        poll_until(lambda: int(attribute(driver, "node-rss-chart", "data-points") or 0) == 10,
                   30, "the node's memory chart")
        assert text(driver, "node-rss") == "309.0 MiB"
        assert "weight_sync" in text(driver, "node-phases-table")

        # the hostile node's page, reached through its link in the nodes table
        driver.get(f"{url}/dashboard")
        link = poll_until(lambda: [a for a in driver.find_elements("css selector", "#nodes-table a")
                                   if a.text == HOSTILE_2], 30, "the hostile node's link")[0]
        link.click()
        poll_until(lambda: text(driver, "node-peer-id") == HOSTILE_2, 30, "the hostile node's page")
        poll_until(lambda: HOSTILE_2 in text(driver, "node-rounds-table"), 30, "its rounds")
        assert driver.execute_script("return window.pwned === undefined")
        assert console_errors(driver) == []

        monitor.off = True
        poll_until(lambda: "health monitor is off" in text(driver, "banner"), 30,
                   "the page to say the monitor is off")
        monitor.off = False
        poll_until(lambda: not driver.find_element("id", "banner").is_displayed(), 30, "the page to recover")
