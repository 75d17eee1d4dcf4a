"""State loading [report 3.3.1.1]: `agora/v1/state` over real libp2p streams in-process, resuming
a stalled transfer at the last received chunk on another peer; and atomic stage checkpoints."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch
from hivemind.p2p import P2P

from protocol import version
from protocol.errors import ErrorCode, RemoteError
from protocol.transport import RpcClient, RpcServer, dial
from roles.worker.state.stage_checkpoint import StageCheckpoints, checkpoint_path
from roles.worker.errors import CheckpointError, StateLoadError
from roles.worker.layout import FlatLayout
from roles.worker.state.state_loader import StateLoader
from roles.worker.state.state_server import StateServer

LAYOUT = FlatLayout(["w", "b"], [(30, 10), (50,)])  # 350 values
CHUNK = 64


class Store:
    def __init__(self, value: float):
        self.lock = threading.RLock()
        self.master_params = [torch.full(shape, value) for shape in LAYOUT.shapes]
        self.pushed = 0

    def push_master_to_device(self):
        self.pushed += 1

    def flat(self):
        return torch.cat([t.reshape(-1) for t in self.master_params])


async def _serve(value: float, *, layout: FlatLayout = LAYOUT, stall_after: int | None = None, serving=True):
    p2p = await P2P.create()
    store = Store(value) if layout is LAYOUT else None
    if store is None:
        store = Store(value)
        store.master_params = [torch.full(shape, value) for shape in layout.shapes]
    server = StateServer(store, layout, run_id="run", stage=1, step=lambda: 40 + int(value),
                         serving=lambda: serving, max_chunk_elements=CHUNK)
    served = 0

    async def handler(peer_id, body):
        nonlocal served
        if stall_after is not None and served >= stall_after:
            await asyncio.sleep(60)  # a chunk that stalls: the fault under test, not a wait
        served += 1
        return await server.handle(peer_id, body)

    rpc = RpcServer(p2p)
    await rpc.add_handler(version.STATE, handler)
    return p2p, rpc, [str(m) for m in await p2p.get_visible_maddrs()]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


@pytest.mark.timeout(120)
def test_a_stalled_transfer_resumes_at_the_last_chunk_on_another_peer():
    async def scenario():
        stalling, stalling_rpc, stalling_maddrs = await _serve(1.0, stall_after=2)
        other_layout, other_rpc, other_maddrs = await _serve(9.0, layout=FlatLayout(["w"], [(350,)]))
        good, good_rpc, good_maddrs = await _serve(2.0)
        client_p2p = await P2P.create()
        client = RpcClient(client_p2p)
        store = Store(0.0)
        loader = StateLoader(client_p2p, client, store, LAYOUT, run_id="run", stage=1, chunk_elements=CHUNK,
                             chunk_timeout_s=1.0, total_timeout_s=60, show_progress=True)
        try:
            peers = [(stalling.peer_id.to_base58(), stalling_maddrs),
                     (other_layout.peer_id.to_base58(), other_maddrs),
                     (good.peer_id.to_base58(), good_maddrs)]
            result = await loader.load(peers)
        finally:
            await client.close()
            for p2p in (stalling, other_layout, good, client_p2p):
                await p2p.shutdown()
        return store, result, peers

    store, result, peers = run(scenario())
    flat = store.flat()
    resumed_at = 2 * CHUNK
    assert torch.all(flat[:resumed_at] == 1.0), "the chunks received before the stall are kept"
    assert torch.all(flat[resumed_at:] == 2.0), "the rest came from the next compatible peer"
    assert result.peers == [peers[0][0], peers[2][0]], "the peer with another layout is never used"
    assert result.resumes == 2 and result.step == 41 and result.elements == LAYOUT.numel
    assert store.pushed == 1


@pytest.mark.timeout(120)
def test_loading_fails_with_a_typed_error_when_nobody_serves():
    async def scenario():
        syncing, rpc, maddrs = await _serve(3.0, serving=False)
        client_p2p = await P2P.create()
        client = RpcClient(client_p2p)
        try:
            await dial(client_p2p, syncing.peer_id, maddrs)
            with pytest.raises(RemoteError) as refused:
                await client.call(syncing.peer_id, version.STATE, {"stage": 1, "offset": 0, "count": 4}, timeout_s=10)
            assert refused.value.code == ErrorCode.NOT_READY
            loader = StateLoader(client_p2p, client, Store(0.0), LAYOUT, run_id="run", stage=1, chunk_elements=CHUNK,
                                 chunk_timeout_s=1.0, total_timeout_s=20, show_progress=False)
            with pytest.raises(StateLoadError, match="every worker"):
                await loader.load([(syncing.peer_id.to_base58(), maddrs)])
            with pytest.raises(StateLoadError, match="no live worker"):
                await loader.load([])
        finally:
            await client.close()
            await syncing.shutdown()
            await client_p2p.shutdown()

    run(scenario())


def test_checkpoints_are_atomic_and_checked(tmp_path):
    writer = StageCheckpoints(str(tmp_path), run_id="run", stage=1, layout=LAYOUT, store=Store(5.0))
    path = writer.save(step=123)
    assert path == checkpoint_path(tmp_path, "run", 1)
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "no temporary file is left behind"
    reader_store = Store(0.0)
    reader = StageCheckpoints(str(tmp_path), run_id="run", stage=1, layout=LAYOUT, store=reader_store)
    assert reader.read_metadata()["step"] == "123"
    assert reader.load() == 123 and torch.all(reader_store.flat() == 5.0) and reader_store.pushed == 1
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)

    other_run = StageCheckpoints(str(tmp_path), run_id="other", stage=1, layout=LAYOUT, store=Store(0.0))
    other_run.path.write_bytes(path.read_bytes())  # a file of another run under this run's name
    with pytest.raises(CheckpointError, match="run_id"):
        other_run.read_metadata()
    other_run.path.unlink()
    wrong_layout = FlatLayout(["w"], [(350,)])
    with pytest.raises(CheckpointError, match="layout"):
        StageCheckpoints(str(tmp_path), run_id="run", stage=1, layout=wrong_layout, store=Store(0.0)).read_metadata()
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a readable"):
        reader.load()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        StageCheckpoints(str(tmp_path / "empty"), run_id="run", stage=1, layout=LAYOUT, store=Store(0.0)).load()
