"""A joiner's side of the donors' RPCs: ask every candidate for its manifest, pick the state to
take, and fetch it from every donor that publishes it (state_download.py).

Which state: replicas of a stage drift apart between averaging rounds, so "the same state" is
byte-identical here, nothing looser: the joiner groups donors by manifest id (the hash of their
snapshot's chunk hashes, state_snapshot.py) and mixes chunks only within one group. It takes the
group at the newest step, and among groups at that step the one with the most donors (more
upload to fetch from); a tie goes to the lowest id, so joiners arriving together converge on the
same group. Replicas whose state is bit-identical (a replica that just loaded from another, or
replicas that step on the same summed gradients and average to the same values) form one group;
replicas that drifted each form their own, and the joiner then downloads from one donor, as
before, with the chunk hashes still checked.

A candidate that does not answer the manifest request (an older node without the handler, or
one that left) is not a donor; when no candidate answers, the caller falls back to
`agora/v1/state` (state_loader.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from hivemind.p2p import P2P, PeerID

from protocol import version
from protocol.errors import AgoraError
from protocol.state_messages import SNAPSHOT_FORMAT, ChunkReply, ChunkRequest, ManifestReply, ManifestRequest
from protocol.transport import RpcClient, dial
from protocol.run_config import SyncConfig
from roles.checkpoint_store import CheckpointStoreError
from roles.worker.errors import StateLoadError
from roles.worker.layout import FlatLayout
from roles.worker.state.run_checkpoint_io import apply_state
from roles.worker.state.state_download import BadChunk, DownloadResult, MultiDonorDownload
from roles.worker.state.state_snapshot import Manifest, SnapshotError, thaw

logger = logging.getLogger(__name__)

MAX_DONORS_ASKED = 8
"""Candidates a joiner asks for a manifest (the fastest first): each one asked freezes a snapshot,
one copy of its stage state, whether it is then chosen or not."""


class DonorSource:
    """One live replica as a `ChunkSource` of one manifest."""

    def __init__(self, client: RpcClient, peer: str, stage: int, manifest_id: str, timeout_s: float):
        self.client = client
        self.name = peer
        self.peer_id = PeerID.from_base58(peer)
        self.stage = stage
        self.manifest_id = manifest_id
        self.timeout_s = timeout_s

    async def chunk(self, index: int) -> bytes:
        reply = await self.client.request(self.peer_id, version.STATE_CHUNK,
                                          ChunkRequest(stage=self.stage, manifest_id=self.manifest_id, index=index),
                                          ChunkReply, timeout_s=self.timeout_s)
        if reply.manifest_id != self.manifest_id or reply.index != index:
            raise BadChunk(f"asked for chunk {index} of {self.manifest_id[:12]}, got chunk {reply.index} of "
                           f"{reply.manifest_id[:12]}")
        return reply.data


@dataclass
class Offer:
    peer: str
    manifest: Manifest


async def fetch_manifests(p2p: P2P, client: RpcClient, candidates: Sequence[tuple[str, list[str]]], *,
                          run_id: str, stage: int, layout: str, timeout_s: float) -> tuple[list[Offer], dict[str, str]]:
    """Every candidate's manifest, in parallel; and why each of the others is not a donor."""
    async def ask(peer: str, maddrs: list[str]) -> Offer:
        peer_id = PeerID.from_base58(peer)
        if maddrs:
            await dial(p2p, peer_id, maddrs, timeout_s)
        reply = await client.request(peer_id, version.STATE_MANIFEST, ManifestRequest(stage=stage), ManifestReply,
                                     timeout_s=timeout_s)
        if reply.run_id != run_id or reply.stage != stage:
            raise SnapshotError(f"it serves run {reply.run_id} stage {reply.stage}")
        if reply.layout != layout or reply.format != SNAPSHOT_FORMAT:
            raise SnapshotError(f"its layout {reply.layout} / format {reply.format} differs from ours")
        return Offer(peer, Manifest.from_reply(reply))

    results = await asyncio.gather(*(ask(p, m) for p, m in candidates), return_exceptions=True)
    offers, refused = [], {}
    for (peer, _), result in zip(candidates, results):
        if isinstance(result, Offer):
            offers.append(result)
        elif isinstance(result, (AgoraError, SnapshotError, asyncio.TimeoutError, OSError)):
            refused[peer] = f"{type(result).__name__}: {result}"
        else:
            raise result
    return offers, refused


def choose(offers: Sequence[Offer]) -> Optional[tuple[Manifest, list[str]]]:
    """The manifest to take and the donors that publish it: newest step, then most donors, then lowest id."""
    groups: dict[str, list[Offer]] = collections.defaultdict(list)
    for offer in offers:
        groups[offer.manifest.manifest_id].append(offer)
    if not groups:
        return None
    best = min(groups.values(), key=lambda g: (-g[0].manifest.step, -len(g), g[0].manifest.manifest_id))
    return best[0].manifest, [o.peer for o in best]


@dataclass
class DonorLoad:
    step: int
    donors: list[str]
    result: DownloadResult
    refused: dict[str, str]


async def load_from_donors(p2p: P2P, client: RpcClient, candidates: Sequence[tuple[str, list[str]]], optimizer,
                           layout: FlatLayout, *, run_id: str, stage: int, sync: SyncConfig) -> Optional[DonorLoad]:
    """Take the stage's state (parameters and optimizer state) from the donors that publish the
    chosen manifest and apply it to `optimizer`; None when no candidate answered as a donor (the
    caller then uses `agora/v1/state`). Raises StateLoadError when the download itself failed."""
    offers, refused = await fetch_manifests(p2p, client, candidates[:MAX_DONORS_ASKED], run_id=run_id, stage=stage,
                                            layout=layout.digest, timeout_s=sync.state_chunk_timeout_s)
    for peer, why in refused.items():
        logger.info("worker %s is not a state donor: %s", peer[-12:], why)
    chosen = choose(offers)
    if chosen is None:
        return None
    manifest, peers = chosen
    others = len({o.manifest.manifest_id for o in offers}) - 1
    logger.info("loading stage %d state at step %d (%.1f MB, %d chunks) from %d donor(s)%s", stage, manifest.step,
                manifest.total_bytes / 1e6, manifest.num_chunks, len(peers),
                f"; {others} other donor state(s) differ from it and are not mixed in" if others else "")
    sources = [DonorSource(client, peer, stage, manifest.manifest_id, sync.state_chunk_timeout_s) for peer in peers]
    download = MultiDonorDownload(manifest, sources, chunk_timeout_s=sync.state_chunk_timeout_s,
                                  total_timeout_s=sync.state_load_timeout_s,
                                  inflight_per_source=sync.donor_chunks_in_flight)
    blob, result = await download.run()
    try:
        _, state = await asyncio.to_thread(thaw, blob, layout.names)
        await asyncio.to_thread(apply_state, state, optimizer, layout, with_optimizer=True)
    except (SnapshotError, CheckpointStoreError) as exc:
        raise StateLoadError(f"the donors' snapshot {manifest.manifest_id[:12]} does not fit this stage: "
                             f"{exc}") from exc
    return DonorLoad(step=manifest.step, donors=peers, result=result, refused=refused)
