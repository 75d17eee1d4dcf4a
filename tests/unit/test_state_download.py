"""Multi-donor state download [issue 22.4]: the canonical snapshot and its manifest, the donor's
handlers (validation, typed refusals, upload cap), and the joiner's work stealing, hash checks
and re-queues against fake donors; and one download over real libp2p streams in-process."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch
from hivemind.p2p import P2P

from protocol import version
from protocol.errors import ErrorCode, PeerUnavailable, ProtocolError, RemoteError
from protocol.state_messages import ManifestReply
from protocol.transport import RpcClient, RpcServer
from roles.worker.state.donor_client import DonorSource, Offer, choose, fetch_manifests
from roles.worker.errors import StateLoadError
from roles.worker.layout import FlatLayout
from roles.worker.steps.optimizer import StageOptimizer
from roles.worker.state.run_checkpoint_io import apply_state
from roles.worker.state.state_donor import StateDonor, TokenBucket
from roles.worker.state.state_download import MultiDonorDownload
from roles.worker.state.state_snapshot import Manifest, SnapshotError, describe, freeze, thaw
from tests.support.faults import SlowBucket

CHUNK = 1 << 16


def _run(coro, timeout_s: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def _stage(seed: int, steps: int = 2):
    """A small model with its StageOptimizer after `steps` steps (so it has AdamW moments)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    opt = StageOptimizer(list(model.parameters()), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                         warmup_steps=0, total_steps=100, min_lr_ratio=0.1, clip_threshold=1.0, device="cpu")
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.add_samples(1)
        opt.step()
    return model, opt, FlatLayout.of_module(model)


def _snapshot(opt, layout, step=None):
    step = opt.local_step if step is None else step
    blob = freeze(layout.names, opt.master_params, opt.state_dict(), run_id="run", stage=1, step=step,
                  layout=layout.digest)
    return blob, describe(blob, CHUNK, run_id="run", stage=1, step=step, layout=layout.digest)


def test_snapshot_is_canonical_and_round_trips_parameters_and_moments():
    _, opt, layout = _stage(0)
    blob, manifest = _snapshot(opt, layout)
    again, manifest2 = _snapshot(opt, layout)
    assert blob == again and manifest.manifest_id == manifest2.manifest_id  # a pure function of the state
    assert manifest.num_chunks == -(-len(blob) // CHUNK) > 2
    _, other, _ = _stage(1)
    assert _snapshot(other, layout)[1].manifest_id != manifest.manifest_id

    _, target, _ = _stage(7, steps=0)
    header, state = thaw(blob, layout.names)
    assert header["step"] == opt.local_step == 2
    apply_state(state, target, layout, with_optimizer=True)
    assert _snapshot(target, layout)[0] == blob  # parameters, moments, step and schedule: all of it
    for mine, theirs in zip(target.master_params, opt.master_params):
        assert torch.equal(mine, theirs)


def test_a_manifest_whose_id_does_not_hash_its_chunks_is_refused():
    _, opt, layout = _stage(0)
    _, manifest = _snapshot(opt, layout)
    reply = manifest.to_reply()
    assert Manifest.from_reply(ManifestReply.model_validate(reply.model_dump())) == manifest
    forged = reply.model_copy(update={"chunks": [b"\0" * 32] + list(reply.chunks[1:])})
    with pytest.raises(SnapshotError, match="not the hash"):
        Manifest.from_reply(forged)
    short = reply.model_copy(update={"chunks": list(reply.chunks[:-1])})
    with pytest.raises(SnapshotError, match="chunk hashes"):
        Manifest.from_reply(short)


def test_a_truncated_or_garbled_snapshot_is_refused():
    _, opt, layout = _stage(0)
    blob, _ = _snapshot(opt, layout)
    with pytest.raises(SnapshotError):
        thaw(blob[: len(blob) // 2], layout.names)
    with pytest.raises(SnapshotError):
        thaw(b"\xff" * 8 + bytes(blob[8:]), layout.names)
    with pytest.raises(SnapshotError, match="misses"):
        thaw(blob, [*layout.names, "extra.weight"])


# ---- the joiner's scheduling against fake donors ----

class FakeDonor:
    """Serves `blob`'s chunks; faults: die after n chunks, a wrong chunk, a chunk that stalls."""

    def __init__(self, name, blob, manifest, *, delay_s=0.0, die_after=None, corrupt=(), stall=(), busy=0):
        self.name, self.blob, self.manifest = name, blob, manifest
        self.delay_s, self.die_after, self.busy = delay_s, die_after, busy
        self.corrupt, self.stall = set(corrupt), set(stall)
        self.asked: list[int] = []

    async def chunk(self, index):
        self.asked.append(index)
        if self.die_after is not None and len(self.asked) > self.die_after:
            raise PeerUnavailable(f"{self.name} is gone")
        if self.busy > 0:
            self.busy -= 1
            raise RemoteError("busy", ErrorCode.OVERLOADED)
        if index in self.stall:
            await asyncio.sleep(3600)  # the fault under test, cut short by the chunk timeout
        await asyncio.sleep(self.delay_s)
        start, end = self.manifest.chunk_range(index)
        data = bytes(self.blob[start:end])
        if index in self.corrupt:
            data = bytes([data[0] ^ 1]) + data[1:]
        return data


def _download(manifest, donors, **kw):
    kw = {"chunk_timeout_s": 5.0, "total_timeout_s": 30.0, "endgame_after_s": 0.3, "show_progress": False, **kw}
    return _run(MultiDonorDownload(manifest, donors, **kw).run())


def test_two_donors_share_the_chunks_and_the_blob_is_exact():
    _, opt, layout = _stage(0)
    blob, manifest = _snapshot(opt, layout)
    a, b = FakeDonor("a", blob, manifest, delay_s=0.01), FakeDonor("b", blob, manifest, delay_s=0.01)
    out, result = _download(manifest, [a, b])
    assert out == blob
    assert result.donors["a"].chunks > 0 and result.donors["b"].chunks > 0
    assert result.donors["a"].chunks + result.donors["b"].chunks == manifest.num_chunks


def test_a_chunk_with_a_wrong_hash_is_refused_its_donor_named_and_the_chunk_fetched_elsewhere(caplog):
    _, opt, layout = _stage(0)
    blob, manifest = _snapshot(opt, layout)
    liar = FakeDonor("liar", blob, manifest, corrupt=range(manifest.num_chunks))
    honest = FakeDonor("honest", blob, manifest, delay_s=0.01)
    out, result = _download(manifest, [liar, honest])
    assert out == blob
    assert result.donors["liar"].failures["bad_hash"] >= 1 and result.donors["liar"].chunks == 0
    assert "wrong hash" in result.donors["liar"].dropped
    assert any("liar" in r.getMessage() and "wrong hash" in r.getMessage() for r in caplog.records)
    refused = [i for i in liar.asked]
    assert all(i in honest.asked for i in refused)  # every chunk it botched came from the honest donor


def test_a_donor_that_dies_mid_transfer_is_dropped_and_its_chunks_requeued():
    _, opt, layout = _stage(0)
    blob, manifest = _snapshot(opt, layout)
    dying = FakeDonor("dying", blob, manifest, delay_s=0.01, die_after=2)
    alive = FakeDonor("alive", blob, manifest, delay_s=0.01)
    out, result = _download(manifest, [dying, alive])
    assert out == blob
    assert result.donors["dying"].chunks == 2 and result.donors["dying"].failures["unavailable"] >= 1
    assert result.donors["alive"].chunks == manifest.num_chunks - 2


def test_a_stalled_chunk_times_out_and_comes_from_another_donor_while_a_busy_one_keeps_its_queue():
    _, opt, layout = _stage(0)
    blob, manifest = _snapshot(opt, layout)
    staller = FakeDonor("staller", blob, manifest, stall={0})
    busy = FakeDonor("busy", blob, manifest, busy=2, delay_s=0.01)
    out, result = _download(manifest, [staller, busy], chunk_timeout_s=1.0, endgame_after_s=60)
    assert out == blob
    assert result.donors["staller"].failures["timeout"] == 1 and 0 in busy.asked
    assert result.donors["busy"].failures["overloaded"] == 2 and result.donors["busy"].dropped is None


def test_a_dead_donor_among_a_slow_and_a_fast_one_leaves_no_chunk_behind():
    _, opt, layout = _stage(0)
    blob, manifest = _snapshot(opt, layout)
    donors = [FakeDonor("dead", blob, manifest, die_after=0), FakeDonor("slow", blob, manifest, delay_s=0.2),
              FakeDonor("fast", blob, manifest)]
    out, result = _download(manifest, donors, endgame_after_s=0.05)
    assert out == blob and result.donors["dead"].chunks == 0 and result.donors["dead"].dropped


def test_endgame_copies_a_slow_donors_last_chunk():
    _, opt, layout = _stage(0)
    blob, manifest = _snapshot(opt, layout)
    slow = FakeDonor("slow", blob, manifest, stall=range(manifest.num_chunks))  # its first requests never end
    fast = FakeDonor("fast", blob, manifest)
    out, result = _download(manifest, [slow, fast], chunk_timeout_s=30.0, endgame_after_s=0.2)
    assert out == blob and result.endgame >= 1 and result.donors["slow"].chunks == 0


def test_when_every_donor_fails_the_download_raises_a_typed_error():
    _, opt, layout = _stage(0)
    blob, manifest = _snapshot(opt, layout)
    donors = [FakeDonor(n, blob, manifest, die_after=1) for n in ("a", "b")]
    with pytest.raises(StateLoadError, match="failed on every donor|every donor failed"):
        _download(manifest, donors)


def test_choose_takes_the_newest_step_then_the_most_donors():
    _, opt, layout = _stage(0)
    _, m2 = _snapshot(opt, layout)
    _, m1 = _snapshot(opt, layout, step=1)
    _, other = _snapshot(_stage(3)[1], layout)
    assert choose([]) is None
    manifest, peers = choose([Offer("x", m1), Offer("y", m2), Offer("z", m1)])
    assert manifest == m2 and peers == ["y"]
    manifest, peers = choose([Offer("x", other), Offer("y", m2), Offer("z", m2)])
    assert manifest == m2 and peers == ["y", "z"]


def test_token_bucket_spaces_bytes_at_its_rate():
    async def go():
        now = [0.0]
        bucket = TokenBucket(1000.0, burst_bytes=500, clock=lambda: now[0])
        first = await bucket.take(500)
        second = await bucket.take(250)  # the clock does not move: the whole 250 bytes must be waited for
        return first, second

    first, second = _run(go())
    assert first == 0.0 and second == pytest.approx(0.25)


# ---- the donor's handlers, called directly ----

def _donor(opt, layout, chunk_delay_s: float = 0.0, **kw):
    """A donor; `chunk_delay_s` pauses before each chunk (tests/support/faults.py, a slow donor)."""
    kw = {"serving": lambda: True, "chunk_bytes": CHUNK, "upload_mbps": 10_000.0, "max_concurrent_chunks": 2,
          "snapshot_ttl_s": 60.0, **kw}
    donor = StateDonor(opt, layout, run_id="run", stage=1, **kw)
    if chunk_delay_s:
        donor.bucket = SlowBucket(donor.bucket, chunk_delay_s)
    return donor


def test_donor_validates_every_request_and_refuses_with_typed_errors():
    _, opt, layout = _stage(0)

    async def go():
        donor = _donor(opt, layout)
        reply = await donor.manifest(None, {"stage": 1})
        again = await donor.manifest(None, {"stage": 1})
        assert again.manifest_id == reply.manifest_id and donor.counters["donor_snapshots_frozen"] == 1
        chunk = await donor.chunk(None, {"stage": 1, "manifest_id": reply.manifest_id, "index": 0})
        assert hashlib.sha256(chunk.data).digest() == reply.chunks[0]
        cases = [({"stage": 2}, "manifest", ErrorCode.WRONG_STAGE),
                 ({"stage": -1}, "manifest", ErrorCode.INVALID_REQUEST),
                 ({"stage": 1, "manifest_id": "f" * 64, "index": 0}, "chunk", ErrorCode.STATE_GONE),
                 ({"stage": 1, "manifest_id": "F" * 64, "index": 0}, "chunk", ErrorCode.INVALID_REQUEST),
                 ({"stage": 1, "manifest_id": reply.manifest_id, "index": len(reply.chunks)}, "chunk",
                  ErrorCode.INVALID_REQUEST),
                 ({"stage": 1, "manifest_id": reply.manifest_id, "index": "0"}, "chunk", ErrorCode.INVALID_REQUEST),
                 ({"stage": 1, "manifest_id": reply.manifest_id}, "chunk", ErrorCode.INVALID_REQUEST)]
        for body, kind, code in cases:
            with pytest.raises(ProtocolError) as caught:
                await getattr(donor, kind)(None, body)
            assert caught.value.code == code, (body, caught.value)
        assert donor.counters["donor_chunk_refused_state_gone"] == 1
        assert donor.counters["donor_chunk_refused_invalid_request"] == 4
        donor.close()

    _run(go())


def test_donor_caps_concurrent_chunks_and_refuses_while_not_serving():
    _, opt, layout = _stage(0)

    async def go():
        serving = [True]
        donor = _donor(opt, layout, serving=lambda: serving[0], max_concurrent_chunks=1, chunk_delay_s=0.3)
        reply = await donor.manifest(None, {"stage": 1})
        body = {"stage": 1, "manifest_id": reply.manifest_id, "index": 0}
        results = await asyncio.gather(donor.chunk(None, body), donor.chunk(None, body), return_exceptions=True)
        refused = [r for r in results if isinstance(r, ProtocolError)]
        assert len(refused) == 1 and refused[0].code == ErrorCode.OVERLOADED
        serving[0] = False
        with pytest.raises(ProtocolError) as caught:
            await donor.manifest(None, {"stage": 1})
        assert caught.value.code == ErrorCode.NOT_READY
        donor.close()

    _run(go())


def test_donor_drops_an_idle_snapshot_and_freezes_a_fresh_one():
    _, opt, layout = _stage(0)

    async def go():
        donor = _donor(opt, layout, snapshot_ttl_s=0.2)
        first = await donor.manifest(None, {"stage": 1})
        for _ in range(100):
            if donor.counters["donor_snapshots_dropped"]:
                break
            await asyncio.sleep(0.05)
        assert donor.counters["donor_snapshots_dropped"] == 1
        with pytest.raises(ProtocolError) as caught:
            await donor.chunk(None, {"stage": 1, "manifest_id": first.manifest_id, "index": 0})
        assert caught.value.code == ErrorCode.STATE_GONE
        await donor.manifest(None, {"stage": 1})
        assert donor.counters["donor_snapshots_frozen"] == 2
        donor.close()

    _run(go())


def test_a_new_joiner_gets_a_fresh_snapshot_once_the_stage_stepped_past_an_idle_one(monkeypatch):
    """Under churn a snapshot kept for its TTL handed a joiner state 56 steps old. A snapshot the
    stage stepped past is refrozen for the next joiner, unless a download is reading it."""
    from roles.worker.state import state_donor

    monkeypatch.setattr(state_donor, "SNAPSHOT_IDLE_BEFORE_REFREEZE_S", 0.1)
    _, opt, layout = _stage(0)

    async def go():
        donor = _donor(opt, layout)
        first = await donor.manifest(None, {"stage": 1})
        opt.set_step(opt.local_step + 3)
        busy = await donor.manifest(None, {"stage": 1})  # read a moment ago: a joiner may be downloading it
        assert busy.manifest_id == first.manifest_id
        await asyncio.sleep(0.15)
        fresh = await donor.manifest(None, {"stage": 1})
        assert fresh.step == first.step + 3 and fresh.manifest_id != first.manifest_id
        assert donor.counters["donor_snapshots_outdated"] == 1 and donor.counters["donor_snapshots_frozen"] == 2
        again = await donor.manifest(None, {"stage": 1})  # the stage has not stepped since: shared
        assert again.manifest_id == fresh.manifest_id
        donor.close()

    _run(go())


# ---- over real libp2p streams ----

def test_download_over_libp2p_from_two_donors_one_of_which_dies():
    _, opt, layout = _stage(0)
    blob, _ = _snapshot(opt, layout)

    async def go():
        joiner = await P2P.create()
        donors, servers = [], []
        for k in range(2):
            p2p = await P2P.create()
            donor = _donor(opt, layout, chunk_delay_s=0.05)
            server = RpcServer(p2p)
            await server.add_handler(version.STATE_MANIFEST, donor.manifest)
            await server.add_handler(version.STATE_CHUNK, donor.chunk)
            donors.append((p2p, donor, [str(m) for m in await p2p.get_visible_maddrs()]))
            servers.append(server)
        client = RpcClient(joiner, timeout_s=5)
        try:
            candidates = [(p2p.peer_id.to_base58(), maddrs) for p2p, _, maddrs in donors]
            offers, refused = await fetch_manifests(joiner, client, candidates, run_id="run", stage=1,
                                                    layout=layout.digest, timeout_s=5)
            assert not refused
            manifest, peers = choose(offers)
            assert len(peers) == 2  # identical state: one manifest id
            sources = [DonorSource(client, peer, 1, manifest.manifest_id, 5) for peer in peers]
            download = MultiDonorDownload(manifest, sources, chunk_timeout_s=5, total_timeout_s=30,
                                          show_progress=False)
            victim = donors[0][0]

            def on_chunk(index, name):
                if download.remaining == manifest.num_chunks - 3:
                    asyncio.get_running_loop().create_task(victim.shutdown())

            download.on_chunk = on_chunk
            out, result = await download.run()
            return out, result, candidates
        finally:
            await client.close()
            for server in servers:
                await server.shutdown()
            for p2p, donor, _ in donors:
                donor.close()
                await p2p.shutdown()
            await joiner.shutdown()

    out, result, candidates = _run(go(), 90)
    assert out == blob
    dead = result.donors[candidates[0][0]]
    assert sum(dead.failures.values()) >= 1 and dead.chunks < result.manifest.num_chunks
    assert result.donors[candidates[1][0]].chunks > 0


def test_an_older_donor_without_the_manifest_handler_is_no_donor_and_the_caller_falls_back():
    from protocol.run_config import SyncConfig
    from roles.worker.state.donor_client import load_from_donors

    _, opt, layout = _stage(0)

    async def go():
        joiner, old = await P2P.create(), await P2P.create()
        server = RpcServer(old)

        async def state(peer_id, body):  # an older node: agora/v1/state only
            return {}

        await server.add_handler(version.STATE, state)
        client = RpcClient(joiner, timeout_s=5)
        try:
            candidates = [(old.peer_id.to_base58(), [str(m) for m in await old.get_visible_maddrs()])]
            offers, refused = await fetch_manifests(joiner, client, candidates, run_id="run", stage=1,
                                                    layout=layout.digest, timeout_s=5)
            loaded = await load_from_donors(joiner, client, candidates, opt, layout, run_id="run", stage=1,
                                            sync=SyncConfig(state_chunk_timeout_s=5))
            return offers, refused, loaded
        finally:
            await client.close()
            await server.shutdown()
            await old.shutdown()
            await joiner.shutdown()

    offers, refused, loaded = _run(go())
    assert offers == [] and len(refused) == 1 and loaded is None


# ---- the checkpoint store as a chunk source ----

def test_a_store_object_is_fetched_by_checked_ranged_reads_and_a_damaged_range_is_refused(tmp_path, monkeypatch):
    import roles.checkpoint_store
    from protocol.run_config import load_run_config
    from roles.checkpoint_store import CheckpointStore, StageEntry
    from roles.model.stage import build_stage_model
    from roles.worker.state.run_checkpoint_io import RunCheckpointWriter, load_latest

    run = load_run_config("tiny", {"run_id": "ranged-unit", "stages": [{"first_layer": 0, "last_layer": 2},
                                                                       {"first_layer": 2, "last_layer": 3}]})
    store = CheckpointStore(f"file://{tmp_path}/store", run.run_id, run.num_stages)
    monkeypatch.setattr(roles.checkpoint_store, "STORE_CHUNK_BYTES", 1 << 16)  # many ranges of a small object
    for stage in range(run.num_stages):  # a checkpoint is complete with every stage's object
        model = build_stage_model(run, stage, device=torch.device("cpu"))
        stage_opt = StageOptimizer.for_stage(run, stage, model.trainable_parameters(), torch.device("cpu"))
        stage_layout = FlatLayout.of_stage(model)
        for p in model.trainable_parameters():
            p.grad = torch.randn_like(p)
        stage_opt.add_samples(1)
        stage_opt.step()
        stage_opt.step()
        writer = RunCheckpointWriter(store, stage=stage, writer=f"peer{stage}", optimizer=stage_opt,
                                     layout=stage_layout, every_steps=2, keep=2, may_write=lambda: True)
        with stage_opt.lock:
            writer.after_step(stage_opt.local_step)
        writer.close(30)
        if stage == 0:
            opt, layout = stage_opt, stage_layout
    entry = store.latest().stages[0]
    assert len(entry.chunks) == -(-entry.bytes // entry.chunk_bytes) > 4
    old = {k: v for k, v in entry.to_json().items() if k not in ("chunks", "chunk_bytes")}
    assert StageEntry.from_json(old).chunks == ()  # an older sidecar: fetched whole, as before

    _, state = load_latest(store, 0, layout, tmp_path / "work", ranged=True)
    for name, tensor in zip(layout.names, opt.master_params):
        assert torch.equal(state.parameters[name], tensor)

    path = tmp_path / "store" / run.run_id / "step-000000002" / entry.file
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert load_latest(store, 0, layout, tmp_path / "work", ranged=True) is None
