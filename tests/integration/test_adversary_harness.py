"""The adversary harness on a real process: a worker started through `adversary_prefix` is the
node itself (its pid, its readiness line, its clean exit) and sends altered outputs.

The proof is exact: a fresh open run's stage has its seeded initial weights (roles/model/stage.py),
so this test computes the honest output in-process and compares the worker's forward and held-out
replies, asked over libp2p as a trainer asks, with three times it. The per-attack effects are
covered in-process by tests/unit/test_adversary.py."""

from __future__ import annotations

import asyncio
import signal
import subprocess

import psutil
import pytest
import torch

from tests.support.adversary_node import adversary_prefix

pytestmark = pytest.mark.integration

STAGE = 1


@pytest.mark.timeout(120)
def test_a_worker_started_through_the_prefix_serves_scaled_outputs_and_logs_its_count(make_swarm, run_config_path):
    from hivemind.p2p import P2P, PeerID

    from protocol import version
    from protocol.messages import EvaluateReply, EvaluateRequest, ForwardReply, ForwardRequest
    from protocol.run_config import load_run_config
    from protocol.transport import RpcClient, dial
    from roles.model.stage import StageModel

    config = run_config_path()
    run = load_run_config(config)
    swarm = make_swarm(config, popen=subprocess.Popen)  # started as a script would, not forked by the tests' zygote
    worker = swarm.start("worker", stage=STAGE, prefix=adversary_prefix("scale:3"))
    assert "tests.support.adversary_node" in psutil.Process(worker.pid).cmdline()  # env exec'd: one process

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, run.model.vocab_size, (run.seq_len,), generator=generator)
    coords = torch.randn(run.seq_len, run.model.subspace_rank, generator=generator) * 0.1
    with torch.no_grad():
        honest = StageModel(run, STAGE)(coords.unsqueeze(0), tokens.unsqueeze(0))[0]

    async def ask() -> tuple[torch.Tensor, torch.Tensor]:
        p2p = await P2P.create(initial_peers=worker.maddrs)
        try:
            peer = PeerID.from_base58(worker.peer_id)
            await dial(p2p, peer, worker.maddrs)
            client = RpcClient(p2p, timeout_s=20)
            forward = await client.request(peer, version.FORWARD, ForwardRequest(
                stage=STAGE, sample_id="s0", tokens=tokens, coords=coords), ForwardReply)
            held_out = await client.request(peer, version.EVALUATE, EvaluateRequest(
                stage=STAGE, sample_id="e0", tokens=tokens, coords=coords), EvaluateReply)
            await client.close()
            return forward.coords, held_out.coords
        finally:
            await p2p.shutdown()

    forward, held_out = asyncio.run(asyncio.wait_for(ask(), 60))
    torch.testing.assert_close(forward.float(), 3 * honest)
    torch.testing.assert_close(held_out.float(), 3 * honest)

    assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
    assert worker.summary() is not None  # the worker's own exit path ran, summary line and all
    with open(worker.log_path, errors="replace") as f:
        log = f.read()
    assert "adversary: scale:3 on this stage-1 body worker" in log
    assert "adversary: altered 1 samples (scale:3)" in log
    assert "adversary: altered 2 samples (scale:3) in all" in log
