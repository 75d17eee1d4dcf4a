"""The CLI contract: one readiness line, one-line errors with exit code 2, persistent identity,
and a real worker that answers hostile requests with typed errors and keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.integration

NODE = [sys.executable, "-m", "node.cli"]
SOME_PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmWihdSgzh9sCzbtjdDf4TqjjArhWeqKoiPTMdcvjpf56J"


@pytest.mark.parametrize("args, fragment", [
    (["--role", "wizard", "--config", "tiny"], "--role"),
    (["--role", "worker", "--config", "tiny", "--stage", "0", "--initial-peers", "/ip4/1.2.3"], "not a multiaddr"),
    (["--role", "worker", "--config", "/nonexistent/run.yaml", "--stage", "0"], "no such file"),
    (["--role", "worker", "--config", "tiny", "--stage", "9"], "out of range"),
    (["--role", "worker", "--config", "tiny"], "--stage"),
    (["--role", "trainer"], "--config"),
    (["--role", "worker", "--config", "tiny", "--stage", "0", "--max-batch", "0"], "--max-batch"),
    (["--role", "trainer", "--config", "tiny", "--initial-peers", SOME_PEER, "--bootstrap-timeout-s", "3",
      "--insecure-open-run"], "initial peer"),
    (["--role", "trainer", "--config", "tiny"], "--authorizer"),
    (["--role", "trainer", "--authorizer", "http://127.0.0.1:9", "--dry-run"], "--dry-run"),
    (["--role", "trainer", "--authorizer", "127.0.0.1:8000"], "has no scheme; write it as a URL"),
    (["--role", "worker", "--authorizer", "http://127.0.0.1:9", "--lanes", "2"], "--lanes is a trainer setting"),
    (["--role", "trainer", "--authorizer", "http://127.0.0.1:9", "--admission-timeout-s", "2"], "gave up after"),
])
def test_bad_input_exits_2_with_one_line(args, fragment):
    result = subprocess.run(NODE + args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("agora-node: error:")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_bad_yaml_config_is_a_one_line_error(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: [unclosed\n")
    result = subprocess.run(NODE + ["--role", "trainer", "--config", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr and str(path) in result.stderr


def test_dry_run_answers_will_it_fit_without_loading():
    # 1b's stage 1 needs about 2.4 GiB of host RAM here: 8b's stage 3 (19 GiB) failed whenever the
    # tests beside it left less than that free on this 24 GiB machine
    result = subprocess.run(NODE + ["--role", "worker", "--config", "1b", "--stage", "1", "--dry-run", "--device",
                                    "cuda", "--gpu-memory", "48GiB", "--max-batch", "1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "stage 1" in result.stdout and "GiB" in result.stdout and "fit" in result.stdout


def test_environment_overrides_config_and_flags_override_environment(tmp_path):
    env = {**os.environ, "AGORA_STAGE": "7", "AGORA_ROLE": "worker", "AGORA_CONFIG": "tiny"}
    result = subprocess.run(NODE + ["--dry-run"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and "--stage 7" in result.stderr
    result = subprocess.run(NODE + ["--dry-run", "--stage", "1"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0 and "stage 1" in result.stdout


@pytest.mark.timeout(120)
def test_identity_keeps_the_peer_id_across_restarts(make_swarm, run_config_path, tmp_path):
    swarm = make_swarm(run_config_path())
    key = str(tmp_path / "worker.key")
    first = swarm.start("worker", stage=0, args=["--identity", key])
    ready_lines = [line for line in first.stdout_lines if line.startswith("agora-node ready")]
    assert len(ready_lines) == 1
    assert ready_lines[0].startswith(f"agora-node ready role=worker stage=0 peer={first.peer_id} maddrs=/ip4/127.0.0.1/")
    assert swarm.stop(first) == 0
    second = swarm.start("worker", stage=0, args=["--identity", key])
    assert second.peer_id == first.peer_id


@pytest.mark.timeout(120)
def test_worker_rejects_hostile_requests_and_keeps_serving(make_swarm, run_config_path):
    from hivemind.p2p import P2P, PeerID

    from protocol import version
    from protocol.codec import encode_tensor, unpack
    from protocol.errors import ErrorCode, RemoteError
    from protocol.framing import read_frame, write_frame
    from protocol.transport import RpcClient, dial

    swarm = make_swarm(run_config_path())
    worker = swarm.start("worker", stage=1)
    seq, rank = 64, 16
    good = {"stage": 1, "sample_id": "ok", "tokens": encode_tensor(torch.zeros(seq, dtype=torch.int64)),
            "coords": encode_tensor(torch.zeros(seq, rank))}
    hostile = [
        ({**good, "stage": 0}, ErrorCode.WRONG_STAGE),
        ({**good, "coords": encode_tensor(torch.zeros(seq, rank + 1))}, ErrorCode.INVALID_TENSOR),
        ({**good, "coords": encode_tensor(torch.full((seq, rank), float("nan")))}, ErrorCode.INVALID_TENSOR),
        ({**good, "tokens": encode_tensor(torch.full((seq,), 10_000, dtype=torch.int64))}, ErrorCode.INVALID_TENSOR),
        ({**good, "tokens": {"dtype": "int64", "shape": [seq], "data": b"\x00"}}, ErrorCode.INVALID_TENSOR),
        ({"stage": 1}, ErrorCode.INVALID_REQUEST),
    ]

    async def scenario():
        p2p = await P2P.create(initial_peers=worker.maddrs)
        try:
            peer = PeerID.from_base58(worker.peer_id)
            await dial(p2p, peer, worker.maddrs)
            client = RpcClient(p2p, timeout_s=10)
            for body, code in hostile:
                with pytest.raises(RemoteError) as info:
                    await client.call(peer, version.FORWARD, body)
                assert info.value.code == code, (body.keys(), info.value)
            _, reader, writer = await p2p.call_binary_stream_handler(peer, version.FORWARD)
            await write_frame(writer, b"\xc1\xc1garbage")
            assert unpack(await read_frame(reader))["error"]["code"] == ErrorCode.MALFORMED_FRAME
            writer.close()
            reply = await client.call(peer, version.FORWARD, good)  # honest requests still work
            assert reply["coords"]["shape"] == [seq, rank]
            await client.close()
        finally:
            await p2p.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 90))
    assert swarm.stop(worker, signal.SIGTERM) == 0
    rejected = worker.summary()["rejected"]
    assert rejected["wrong_stage"] == 1 and rejected["malformed_frame"] == 1
    assert rejected["invalid_tensor"] == 4 and rejected["invalid_request"] == 1


@pytest.mark.timeout(120)
def test_authorizer_role_serves_and_stops_cleanly(tmp_path):
    import httpx

    proc = subprocess.Popen(NODE + ["--role", "authorizer", "--config", "tiny", "--port", "0",
                                    "--data-dir", str(tmp_path / "auth")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("agora-node ready role=authorizer stage=- peer=- url=http://127.0.0.1:"), line
        url = line.rsplit("url=", 1)[1]
        info = httpx.get(f"{url}/v1/run", timeout=10).json()
        assert info["run_id"] == "tiny" and len(info["stages"]) == 3
        assert httpx.get(f"{url}/openapi.json", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert oct((tmp_path / "auth" / "root.key").stat().st_mode & 0o777) == "0o600"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
