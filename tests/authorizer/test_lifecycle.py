"""The authorizer process: its one readiness line, clean exits on SIGTERM and SIGINT, a root key
and policy that survive restarts, refusals of bad configuration, and the queue sweeper."""

from __future__ import annotations

import base64
import os
import re
import signal
import stat
import subprocess
import sys

import httpx
import pytest

from authorizer.testing import NodeKey
from protocol.credentials import SignedCredential, verify_credential
from tests.authorizer.helpers import ADMIN, ADMIN_TOKEN
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(120)
READY = re.compile(r"^agora-node ready role=authorizer stage=- peer=- url=http://127\.0\.0\.1:(\d+)$")
CHECKS = ("--checks", "capability,integrity")


def test_ready_line_and_clean_exit_on_signals(start_authorizer, tmp_path):
    for sig in (signal.SIGTERM, signal.SIGINT):
        authorizer = start_authorizer(*CHECKS, data_dir=str(tmp_path / "data"))
        assert READY.match(authorizer.stdout_lines[0]), authorizer.stdout_lines
        assert httpx.get(f"{authorizer.url}/openapi.json").json()["info"]["title"] == "agora-node authorizer"
        authorizer.proc.send_signal(sig)
        assert authorizer.proc.wait(30) == 0, authorizer.log_tail()
        assert len(authorizer.stdout_lines) == 1  # stdout carries the readiness line only; logs go to stderr


def test_restart_keeps_root_key_policy_and_records(start_authorizer, tmp_path):
    data = str(tmp_path / "data")
    first = start_authorizer(*CHECKS, "--join-rate", "500", data_dir=data)
    key_file = os.path.join(data, "root.key")
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    node = NodeKey.generate()
    with httpx.Client(base_url=first.url, timeout=30) as http:
        root = http.get("/v1/run").json()["authorizer_public_key"]
        ticket = http.post("/v1/join", json=node.join_body()).json()
        done = poll_until(lambda: (t := http.get(f"/v1/join/{ticket['ticket']}").json())["status"] == "admitted" and t,
                          10, "admission")
        assert http.patch("/v1/admin/policy", json={"trainer_capacity": 3}, headers=ADMIN).status_code == 200
    assert first.stop() == 0

    second = start_authorizer(*CHECKS, data_dir=data)  # no --join-rate this time
    with httpx.Client(base_url=second.url, timeout=30) as http:
        run = http.get("/v1/run").json()
        assert run["authorizer_public_key"] == root
        assert run["trainers"]["capacity"] == 3  # the operator's live change survived
        assert run["join_rate_per_s"] == 500  # and so did the last explicit setting
        again = http.get(f"/v1/join/{ticket['ticket']}").json()
        assert again["status"] == "admitted"
        signed = SignedCredential.from_bytes(base64.b64decode(again["admission"]["credential_msgpack"]))
        verify_credential(base64.b64decode(root), signed, peer_id=node.peer_id, run_id="tiny")
        assert signed == SignedCredential.from_bytes(base64.b64decode(done["admission"]["credential_msgpack"]))
        renewed = http.post("/v1/renew", json=node.proof_body("renew", "tiny"))
        assert renewed.status_code == 200
    assert second.stop() == 0
    third = start_authorizer(*CHECKS, "--trainer-capacity", "9", data_dir=data)  # an explicit flag wins
    assert httpx.get(f"{third.url}/v1/run").json()["trainers"]["capacity"] == 9


def _run_main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "node.cli", "--role", "authorizer", "--port", "0", "--admin-token", ADMIN_TOKEN,
                           *args], capture_output=True, text=True, timeout=60)


def test_bad_configuration_exits_2_with_one_line(tmp_path):
    data = str(tmp_path / "data")
    cases = [
        (["--stage-capacity", "1,2"], "one value for all stages or one per stage"),
        (["--db", "mysql://x/y"], "sqlite:///"),
        (["--checks", "capability,telepathy"], "unknown check"),
        (["--run-config", "nonexistent.yaml"], "preset"),
        (["--policy-file", str(tmp_path / "missing.yaml")], "does not exist"),
    ]
    for args, phrase in cases:
        done = _run_main("--data-dir", data, *args)
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert phrase in done.stderr and done.stdout == "", (args, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, "root.key"), "w") as handle:
        handle.write("not a key")
    os.chmod(os.path.join(data, "root.key"), 0o644)
    done = _run_main("--data-dir", data)
    assert done.returncode == 2 and "chmod 600" in done.stderr


def test_database_of_another_run_is_refused(start_authorizer, tmp_path):
    from protocol.run_config import dump_run_config, load_run_config

    db = f"sqlite:///{tmp_path}/shared.db"
    start_authorizer(*CHECKS, db=db).stop()
    other = tmp_path / "other.yaml"
    dump_run_config(load_run_config("tiny", {"run_id": "other-run"}), other)
    done = _run_main("--data-dir", str(tmp_path / "data"), "--db", db, "--run-config", str(other))
    assert done.returncode == 2 and "belongs to run 'tiny'" in done.stderr


def test_queued_ticket_nobody_polls_is_swept(start_authorizer, tmp_path):
    authorizer = start_authorizer(*CHECKS, "--join-rate", "0.001", "--join-burst", "1")
    with httpx.Client(base_url=authorizer.url, timeout=30) as http:
        http.patch("/v1/admin/policy", json={"queue_idle_timeout_s": 1}, headers=ADMIN)
        tickets = [http.post("/v1/join", json=NodeKey.generate().join_body(account_token=f"a{i}")).json()
                   for i in range(2)]
        queued = [t for t in tickets if t["status"] == "queued"]
        assert queued
        stage = queued[-1]["stage"]
        # /v1/run does not touch the ticket, so polling it lets the ticket go idle and be swept
        poll_until(lambda: http.get("/v1/run").json()["stages"][stage]["queued"] == 0, 16.5, "the sweeper",
                   period_s=0.5)
        swept = http.get(f"/v1/join/{queued[-1]['ticket']}").json()
        assert swept["status"] == "abandoned"


def test_default_credential_lifetime_matches_the_protocol():
    from authorizer.config import DEFAULT_CREDENTIAL_TTL_S
    from protocol import credentials

    assert DEFAULT_CREDENTIAL_TTL_S == credentials.DEFAULT_CREDENTIAL_TTL_S


def test_restart_without_port_serves_the_same_url_and_root_key(start_authorizer, tmp_path):
    """Given --port once, the authorizer records the bound port in its data directory; the same
    command without --port serves the same URL, signing with the same root key."""
    import json

    data = str(tmp_path / "data")
    first = start_authorizer(*CHECKS, data_dir=data)  # --port 0: the OS picks the port
    root = httpx.get(f"{first.url}/v1/run").json()["authorizer_public_key"]
    stored = json.loads((tmp_path / "data" / "authorizer.json").read_text())
    assert f"http://{stored['host']}:{stored['port']}" == first.url and stored["run_config"] == "tiny"
    assert stat.S_IMODE(os.stat(tmp_path / "data" / "authorizer.json").st_mode) == 0o600
    assert first.stop() == 0
    second = start_authorizer(*CHECKS, data_dir=data, port=None)
    assert second.url == first.url
    assert httpx.get(f"{second.url}/v1/run").json()["authorizer_public_key"] == root


def test_port_in_use_is_one_line_and_exit_2(start_authorizer, tmp_path):
    running = start_authorizer(*CHECKS)
    port = running.url.rsplit(":", 1)[1]
    done = subprocess.run([sys.executable, "-m", "node.cli", "--role", "authorizer", "--port", port, "--data-dir",
                           str(tmp_path / "other"), "--admin-token", ADMIN_TOKEN], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert f"127.0.0.1:{port} is already in use" in lines[0] and "--port" in lines[0]
    assert "Traceback" not in done.stderr and "Task exception" not in done.stderr


def test_defaults_port_8000_and_data_dir_outside_the_working_directory(monkeypatch, tmp_path):
    from authorizer.config import AuthorizerConfig

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    config = AuthorizerConfig()
    assert config.port == 8000
    assert config.data_dir == str(tmp_path / "xdg" / "agora-node" / "authorizer")
    monkeypatch.delenv("XDG_DATA_HOME")
    assert AuthorizerConfig().data_dir == os.path.expanduser("~/.local/share/agora-node/authorizer")


def test_sigkill_takes_the_health_monitors_processes_along(start_authorizer, tmp_path):
    """A SIGKILLed authorizer leaves nothing of its health monitor behind: its DHT process, p2pd and
    torch's shared-memory manager end, and p2pd's unix sockets are removed."""
    import psutil

    authorizer = start_authorizer(data_dir=str(tmp_path / "data"))
    try:
        poll_until(lambda: re.search(r"health monitor \S+ listening on", authorizer.log_tail()), 90,
                   "the health monitor's DHT to start", period_s=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{authorizer.log_tail()}") from None
    children = psutil.Process(authorizer.proc.pid).children(recursive=True)
    assert any("p2pd" in child.name() for child in children), [child.name() for child in children]
    sockets = {c.laddr for child in children for c in child.net_connections(kind="unix")
               if isinstance(c.laddr, str) and c.laddr.startswith("/tmp/hivemind-")}
    assert sockets, "p2pd's unix sockets"
    authorizer.proc.kill()
    authorizer.proc.wait(10)
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [(p.pid, p.name()) for p in alive]
    poll_until(lambda: not any(os.path.exists(path) for path in sockets), 15, "the unix sockets to be removed")
