"""The monitor's tables on SQLite and PostgreSQL: a snapshot written and read back by the API's
queries, totals and cursors resumed after a restart, alerts resolved; and the webhook's POSTs to a
real local HTTP server."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import uuid

import pytest

from authorizer.monitor.health import Alert
from authorizer.monitor.membership import NodeState
from authorizer.monitor.notify import Notifier
from authorizer.monitor.progress import Cursor
from authorizer.monitor.store import MonitorStore, SnapshotWrite
from authorizer.store import open_engines
from protocol.errors import ConfigError

PEER = "12D3KooWPeerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/monitor.db"
    url = request.getfixturevalue("postgres").create_database(f"m_{uuid.uuid4().hex[:12]}")
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


def _snapshot(t: float, *, samples: int, raised=(), resolved=(), state: str = "present",
              eval_loss: float | None = None, eval_step: int | None = None,
              eval_stderr: float | None = None) -> SnapshotWrite:
    node = NodeState(peer_id=PEER, role="worker", stage=1, first_seen=1.0, last_seen=t, state=state, phase="active",
                     throughput=3.0, step=4, samples=32, last_expiration=t + 3, ttl_s=3.0,
                     rounds=[{"round": 1, "status": "complete", "finished_at": t}])
    stage = {"stage": 1, "replicas": 1, "min_replicas": 1, "step": 4, "throughput": 3.0,
             "phases": {"active": 1, "weight_sync": 0, "optimizer_sync": 0, "leaving": 0},
             "averaging": {"complete": 1, "partial": 0, "failed": 0, "skipped": 0, "success_rate": 1.0,
                           "last_round_at": t}}
    return SnapshotWrite(
        t=t, interval_s=2.0, nodes=[node], node_samples=[dict(peer_id=PEER, t=t, phase="active", throughput=3.0,
                                                              step=4, samples=32, rss_bytes=None, rounds_complete=1,
                                                              rounds_failed=0)],
        stages=[stage], progress=dict(samples=samples, tokens=samples * 10, loss=2.5, tokens_per_s=1.0, trainers=1,
                                      eval_loss=eval_loss, eval_step=eval_step, eval_stderr=eval_stderr),
        cursors=[Cursor(peer_id=PEER, process=1, samples=samples, tokens=samples * 10, report_time=t)],
        totals=(samples, samples * 10), best_loss=2.5, raised=list(raised), refreshed=[], resolved=list(resolved))


def test_a_snapshot_is_written_read_back_and_resumed(db_url):
    store = MonitorStore(*open_engines(db_url))
    store.open("run-a")
    assert store.overview() is None, "no snapshot yet"
    alert = Alert(kind="stalled", severity="critical", subject="stage 1", message="stalled", first_at=10.0,
                  last_at=10.0)
    store.write(_snapshot(10.0, samples=8, raised=[alert]))
    assert alert.id is not None
    store.write(_snapshot(12.0, samples=20, eval_loss=2.75, eval_step=40, eval_stderr=0.03))

    overview = store.overview()
    assert overview["updated_at"] == 12.0 and overview["interval_s"] == 2.0
    assert overview["training"] == {"samples": 20, "tokens": 200, "loss": 2.5, "tokens_per_s": 1.0, "trainers": 1,
                                    "eval_loss": 2.75, "eval_step": 40, "eval_stderr": 0.03}
    assert [(p["eval_loss"], p["eval_step"], p["eval_stderr"]) for p in store.progress(None, 10)] == [
        (None, None, None), (2.75, 40, 0.03)]
    assert overview["stages"][0]["stage"] == 1 and overview["nodes"] == {"present": 1, "gone": 0}
    assert [a["kind"] for a in overview["alerts"]] == ["stalled"]
    assert [p["samples"] for p in store.progress(None, 10)] == [8, 20]
    assert [p["samples"] for p in store.progress(10.0, 10)] == [20]
    assert [p["samples"] for p in store.progress(None, 1)] == [20], "without since: the newest, oldest first"
    node = store.node(PEER)
    assert node["node"]["stage"] == 1 and [h["t"] for h in node["history"]] == [10.0, 12.0]
    assert node["rounds"][0]["status"] == "complete" and store.node("12D3KooWUnknown") is None

    alert.resolved_at = 14.0
    store.write(_snapshot(14.0, samples=20, resolved=[alert], state="gone"))
    assert store.alerts(True) == [] and [a["resolved_at"] for a in store.alerts(False)] == [14.0]
    assert len(store.alerts(None)) == 1

    resumed = MonitorStore(*open_engines(db_url))
    resumed.open("run-a")
    loaded = resumed.load()
    assert (loaded.samples, loaded.tokens, loaded.best_loss) == (20, 200, 2.5)
    assert loaded.cursors[PEER].samples == 20 and loaded.nodes[PEER].state == "gone" and loaded.alerts == []
    assert loaded.nodes[PEER].first_seen == 1.0 and loaded.losses == [2.5, 2.5, 2.5]
    assert resumed.placements() is None, "a database without admissions: nothing to reconcile"
    with pytest.raises(ConfigError, match="belong to run 'run-a'"):
        MonitorStore(*open_engines(db_url)).open("run-b")


def test_tables_of_an_older_monitor_gain_the_heldout_columns(db_url):
    from sqlalchemy import inspect

    from authorizer.monitor.tables import monitor_metadata

    write_engine, read_engine = open_engines(db_url)
    monitor_metadata.create_all(write_engine)
    with write_engine.begin() as conn:  # the progress table as the first release created it
        for column in ("eval_loss", "eval_step", "eval_stderr"):
            conn.exec_driver_sql(f"ALTER TABLE monitor_progress DROP COLUMN {column}")
    store = MonitorStore(write_engine, read_engine)
    store.open("run-a")
    with read_engine.connect() as conn:
        assert {"eval_loss", "eval_step", "eval_stderr"} <= {c["name"] for c in
                                                              inspect(conn).get_columns("monitor_progress")}
    store.write(_snapshot(10.0, samples=8, eval_loss=3.5, eval_step=0))
    assert store.overview()["training"]["eval_loss"] == 3.5
    MonitorStore(write_engine, read_engine).open("run-a")  # opening again changes nothing


class _Hook(http.server.BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(json.loads(body))
        self.send_response(204 if self.path == "/ok" else 500)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_alerts_are_posted_to_the_webhook_and_failures_only_logged(caplog):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    _Hook.received = []
    alert = Alert(id=3, kind="forged_trainer_report", severity="critical", subject=PEER, message="forged",
                  first_at=1.0, last_at=1.0)

    async def send() -> tuple[Notifier, Notifier]:
        ok, failing = Notifier("run-a", f"{base}/ok"), Notifier("run-a", f"{base}/fail")
        ok.alert("raised", alert)
        failing.alert("raised", alert)
        await ok.aclose(timeout_s=10)
        await failing.aclose(timeout_s=10)
        return ok, failing

    try:
        ok, failing = asyncio.run(send())
    finally:
        server.shutdown()
        server.server_close()
    assert (ok.posted, ok.failed, failing.posted, failing.failed) == (1, 0, 0, 1)
    assert _Hook.received[0] == {"run_id": "run-a", "event": "raised", "alert": alert.as_json()}
    assert any("alert forged_trainer_report [critical]" in r.getMessage() for r in caplog.records)
    assert any("alert webhook" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
