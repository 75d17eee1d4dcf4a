"""The health monitor in a live authenticated swarm [report 3.6.2]: a real authorizer runs its
in-process monitor (a snapshot every 2 s), real workers and trainers join it, and the JSON API
shows what happened: a SIGKILLed worker is recorded as gone within two intervals and keeps its
history after its DHT record expired; a forged trainer report and an announcement under an
unplanned stage raise alerts; training progress is counted exactly once, across a restart of the
monitor too. One swarm serves every check, in that order."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import httpx
import pytest

from authorizer.testing import AuthorizerProcess
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

ADMIN = "monitor-admin-token-0123456789"
INTERVAL_S = 2.0
TWO_STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]
OVERVIEW_KEYS = {"run_id", "num_stages", "updated_at", "interval_s", "stages", "training", "nodes", "alerts"}
STAGE_KEYS = {"stage", "replicas", "min_replicas", "phases", "step", "throughput", "averaging"}
NODE_KEYS = {"peer_id", "role", "stage", "state", "phase", "first_seen", "last_seen", "throughput", "step", "admitted"}
ALERT_KEYS = {"id", "kind", "severity", "subject", "message", "first_at", "last_at", "resolved_at"}


def _get(url: str, path: str, **params) -> dict:
    response = httpx.get(url + path, params=params, timeout=10)
    assert response.status_code == 200, (path, response.status_code, response.text)
    return response.json()


def _node(url: str, peer_id: str):
    return next((n for n in _get(url, "/v1/monitor/nodes")["nodes"] if n["peer_id"] == peer_id), None)


def _alerts(url: str) -> list[dict]:
    return _get(url, "/v1/monitor/alerts")["alerts"]


async def _forge(authorizer_url: str, tmp_path, initial_peers: list[str]) -> tuple[str, int]:
    """A peer admitted as a worker writes a trainer report and announces itself under the stage it
    was not placed on, both signed with its real worker credential; returns (peer id, its stage)."""
    from hivemind.p2p import P2P

    from node.admission import AuthorizerClient, join_run
    from node.swarm import join_swarm
    from protocol.auth_state import SharedAuthState
    from protocol.dht import SwarmDHT
    from protocol.dht_auth import CredentialDHTAuthorizer
    from protocol.dht_schema import TrainerRecord, WorkerRecord, trainers_key, workers_key
    from protocol.identity import load_or_create_identity

    identity = load_or_create_identity(str(tmp_path / "forger.key"))
    p2p = await P2P.create(identity_path=identity.path, check_if_identity_free=False)  # for the dial-back
    client = AuthorizerClient(authorizer_url)
    try:
        visible = [str(m) for m in await p2p.get_visible_maddrs()]
        admission = await join_run(client, identity, "worker", announce_maddrs=visible,
                                   hardware={"device_name": "cpu", "vram_bytes": 0, "ram_bytes": 1 << 36,
                                             "bandwidth_mbps": 1000.0, "latency_ms": 1.0})
    finally:
        await client.close()
        await p2p.shutdown()
    run_id, stage = admission.credential.credential.run_id, admission.stage
    state = SharedAuthState(str(tmp_path / "forger-trust"), run_id=run_id, root_public_key=admission.root_public_key)
    state.publish_credential(admission.credential)
    membership = await asyncio.to_thread(
        join_swarm, identity=identity, run_id=run_id, num_stages=2, initial_peers=initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[], bootstrap_timeout_s=60, auth_state=state,
        authorizer=CredentialDHTAuthorizer(identity, state))
    try:
        dht = SwarmDHT(membership.dht, identity.peer_id.to_base58())
        report = TrainerRecord(samples_completed=10**9, samples_dropped=0, tokens=10**12, last_loss=0.01,
                               time=time.time())
        await dht.store(trainers_key(run_id), report, 60)
        await dht.store(workers_key(run_id, 1 - stage), WorkerRecord(stage=1 - stage, max_batch=8, throughput=1.0), 60)
    finally:
        await asyncio.to_thread(membership.shutdown)
    return identity.peer_id.to_base58(), stage


def sqlite_totals(path) -> int:
    """The samples the monitor had counted, read from its database while no authorizer runs."""
    import json
    import sqlite3

    with sqlite3.connect(str(path)) as conn:
        return json.loads(conn.execute("SELECT value FROM monitor_state WHERE key = 'samples'").fetchone()[0])


def _wait_counted(url: str, samples: int, tokens: int, timeout_s: float) -> dict:
    """Wait for the monitor's totals to reach (samples, tokens); fail at once on more (double counting)."""
    def reached():
        training = _get(url, "/v1/monitor/overview")["training"]
        assert training["samples"] <= samples and training["tokens"] <= tokens, (training, samples, tokens)
        return training if (training["samples"], training["tokens"]) == (samples, tokens) else None

    return poll_until(reached, timeout_s, f"the monitor to count {samples} samples and {tokens} tokens", period_s=0.5)


@pytest.mark.timeout(600)
def test_health_monitor_in_a_live_swarm(make_swarm, run_config_path, tmp_path):
    config = run_config_path(stages=TWO_STAGES, run_id=f"mon-{uuid.uuid4().hex[:6]}")
    args = ["--run-config", config, "--data-dir", str(tmp_path / "authorizer"), "--credential-ttl-s", "600",
            "--admin-token", ADMIN, "--stage-capacity", "4", "--monitor-interval-s", str(INTERVAL_S)]
    authorizer = AuthorizerProcess([*args, "--port", "0"], log_path=str(tmp_path / "authorizer.log"))
    restarted = None
    try:
        authorizer.start()
        url = authorizer.url
        swarm = make_swarm(None)
        node_args = ["--authorizer", url, "--announce-period-s", "1"]
        workers = [swarm.start("worker", args=node_args) for _ in range(2)]
        assert sorted(w.stage for w in workers) == [0, 1]

        # the API answers the contract; both workers are present, each on its stage
        def both_present():
            overview = _get(url, "/v1/monitor/overview")
            return overview if all(s["replicas"] >= 1 for s in overview["stages"]) else None

        overview = poll_until(both_present, 90, "both workers present in the monitor's overview", period_s=0.5)
        assert OVERVIEW_KEYS <= set(overview) and overview["num_stages"] == 2 and overview["interval_s"] == INTERVAL_S
        assert all(STAGE_KEYS <= set(s) for s in overview["stages"])
        assert set(overview["nodes"]) >= {"present", "gone", "admitted", "queued"}
        assert overview["nodes"]["admitted"] == 2
        listed = _get(url, "/v1/monitor/nodes")["nodes"]
        assert all(NODE_KEYS <= set(n) for n in listed)
        assert {(n["peer_id"], n["stage"]) for n in listed} >= {(w.peer_id, w.stage) for w in workers}
        assert httpx.get(f"{url}/v1/monitor/nodes/not-a-peer-id", timeout=10).json()["error"]["code"] == "not_found"
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "agora_monitor_stage_replicas{" in metrics and "agora_monitor_alerts_active{" in metrics

        # 1. a SIGKILLed worker is gone within two intervals and keeps its history
        victim = swarm.start("worker", args=["--authorizer", url, "--announce-period-s", "0.5"])
        poll_until(lambda: (n := _node(url, victim.peer_id)) and n["state"] == "present", 60,
                   "the third worker present", period_s=0.5)
        poll_until(lambda: len(_get(url, f"/v1/monitor/nodes/{victim.peer_id}")["history"]) >= 2, 30,
                   "two history samples of the third worker", period_s=0.5)
        killed_at = time.time()
        swarm.stop(victim, signal.SIGKILL)
        gone = poll_until(lambda: (n := _node(url, victim.peer_id)) and n["state"] == "gone" and n, 30,
                          "the killed worker recorded as gone", period_s=0.2)
        gone_after_s = gone["gone_at"] - killed_at
        print(f"killed worker recorded gone {gone_after_s:.2f} s after SIGKILL (interval {INTERVAL_S} s)")
        assert gone_after_s <= 2 * INTERVAL_S + 0.5, gone_after_s  # half a second for the kill and a read
        # its record (TTL 1.5 s) has lapsed by the next snapshots; the monitor still has it all
        poll_until(lambda: _get(url, "/v1/monitor/overview")["updated_at"] > killed_at + 3 * INTERVAL_S, 30,
                   "two more snapshots", period_s=0.5)
        detail = _get(url, f"/v1/monitor/nodes/{victim.peer_id}")
        assert detail["node"]["state"] == "gone" and detail["node"]["stage"] == victim.stage
        assert detail["node"]["first_seen"] < detail["node"]["last_seen"] <= gone["gone_at"]
        assert len(detail["history"]) >= 2 and all(h["t"] < gone["gone_at"] for h in detail["history"])

        # 2. a forged trainer report and an unplanned stage raise alerts naming the peer
        forger, placed = asyncio.run(asyncio.wait_for(_forge(url, tmp_path, workers[0].maddrs), 120))

        def raised():
            found = {(a["kind"], a["subject"]) for a in _alerts(url)}
            return {("forged_trainer_report", forger), ("unplanned_stage", forger)} <= found

        poll_until(raised, 30, "forged_trainer_report and unplanned_stage alerts", period_s=0.5)
        alerts = {a["kind"]: a for a in _get(url, "/v1/monitor/alerts", active="true")["alerts"]}
        assert all(ALERT_KEYS <= set(a) for a in alerts.values())
        assert alerts["forged_trainer_report"]["severity"] == "critical"
        assert f"stage {1 - placed}" in alerts["unplanned_stage"]["message"]
        # the overview is cached for a second apart from the alerts list: it may lag by that
        poll_until(lambda: {"forged_trainer_report", "unplanned_stage"} <= {
            a["kind"] for a in _get(url, "/v1/monitor/overview")["alerts"]}, 10, "the alerts in the overview",
            period_s=0.3)
        assert _get(url, "/v1/monitor/overview")["training"]["samples"] == 0, "the forged report was not counted"

        # 3. progress is counted once: the monitor's totals are the trainer's own final counters
        trainer = swarm.start("trainer", args=[*node_args, "--max-samples", "24", "--lanes", "2"])
        assert swarm.wait(trainer, 180) == 0, trainer.log_tail()
        first = trainer.summary()
        _wait_counted(url, first["samples_completed"], first["tokens"], 6 * INTERVAL_S)
        points = _get(url, "/v1/monitor/progress")["points"]
        assert points and points[-1]["samples"] == first["samples_completed"]
        assert [p["t"] for p in points] == sorted(p["t"] for p in points)

        # 4. ... and across a restart of the monitor (the authorizer) in the middle of a trainer's run:
        # the restarted monitor resumes from its cursors instead of counting the trainer's counters again
        second_trainer = swarm.start("trainer", args=[*node_args, "--lanes", "1"])
        poll_until(lambda: _get(url, "/v1/monitor/overview")["training"]["samples"] > first["samples_completed"],
                   120, "the second trainer's first samples counted", period_s=0.5)
        assert authorizer.stop() == 0
        counted_before = sqlite_totals(tmp_path / "authorizer" / "authorizer.db")
        restarted = AuthorizerProcess(args, log_path=str(tmp_path / "authorizer-restarted.log")).start()
        assert restarted.url == url
        poll_until(lambda: _get(url, "/v1/monitor/overview")["training"]["samples"] > counted_before, 120,
                   "the restarted monitor counting the second trainer's new samples", period_s=0.5)
        assert swarm.stop(second_trainer, signal.SIGTERM) == 0, second_trainer.log_tail()
        second = second_trainer.summary()
        _wait_counted(url, first["samples_completed"] + second["samples_completed"],
                      first["tokens"] + second["tokens"], 10 * INTERVAL_S)
        assert _node(url, victim.peer_id)["state"] == "gone", "the history survived the restart"
    finally:
        authorizer.stop()
        if restarted is not None:
            restarted.stop()


class _Monitor:
    """`agora-node --role monitor ...` in its own process group, with its readiness line."""

    def __init__(self, argv: list[str], log_path: str):
        import subprocess
        import sys

        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "node.cli", "--role", "monitor", *argv],
                                         stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        self.log_path = log_path
        self.lines: list[str] = []
        import threading

        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]

    def kill(self) -> None:
        import os

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.mark.timeout(300)
def test_standalone_monitor(make_swarm, run_config_path, tmp_path):
    """`agora-node --role monitor` beside an authorizer run with --no-monitor: refused without the
    admin token, admitted with it, writes into the authorizer's database (whose API then serves its
    history), and stops cleanly on SIGTERM."""
    config = run_config_path(stages=TWO_STAGES, run_id=f"mon-{uuid.uuid4().hex[:6]}")
    data = tmp_path / "authorizer"
    authorizer = AuthorizerProcess(["--run-config", config, "--data-dir", str(data), "--port", "0", "--admin-token",
                                    ADMIN, "--no-monitor", "--credential-ttl-s", "600"],
                                   log_path=str(tmp_path / "authorizer.log"))
    monitors: list[_Monitor] = []
    try:
        authorizer.start()
        url = authorizer.url
        off = httpx.get(f"{url}/v1/monitor/overview", timeout=10)
        assert off.status_code == 503 and off.json()["error"]["code"] == "monitor_off"
        assert "--role monitor" in off.json()["error"]["message"]
        swarm = make_swarm(None)
        worker = swarm.start("worker", args=["--authorizer", url, "--announce-period-s", "1"])

        argv = ["--authorizer", url, "--db", f"sqlite:///{data}/authorizer.db", "--interval-s", "1",
                "--identity", str(tmp_path / "monitor.key"), "--admission-timeout-s", "60"]
        refused = _Monitor([*argv, "--account-token", "not-the-admin-token"], str(tmp_path / "refused.log"))
        monitors.append(refused)
        assert refused.proc.wait(120) == 4, refused.log_tail()  # ExitCode.ADMISSION_REJECTED
        assert "monitor_not_authorized" in refused.log_tail()

        monitor = _Monitor([*argv, "--account-token", ADMIN], str(tmp_path / "monitor.log"))
        monitors.append(monitor)
        poll_until(lambda: any(line.startswith("agora-node ready role=monitor") for line in monitor.lines)
                   or monitor.proc.poll() is not None, 120, "the monitor's readiness line", period_s=0.2)
        assert monitor.proc.poll() is None, monitor.log_tail()
        node = poll_until(lambda: httpx.get(f"{url}/v1/monitor/overview", timeout=10).status_code == 200
                          and _node(url, worker.peer_id), 60, "the worker in the standalone monitor's history",
                          period_s=0.5)
        assert node["state"] == "present" and node["stage"] == worker.stage and node["admitted"]
        monitor.proc.send_signal(signal.SIGTERM)
        assert monitor.proc.wait(30) == 0, monitor.log_tail()
    finally:
        for monitor in monitors:
            monitor.kill()
        authorizer.stop()
