"""A worker's SparseLoCo on the swarm: the transport its stage's config names, the
`agora/v1/sparseloco_fragment` handler the swarm transport pushes to, and the push itself, over
the replicas' authenticated streams (roles/worker/serving/replicas.py dials and checks membership)."""

from __future__ import annotations

import time

from protocol import version
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import SparseLoCoFragmentReply, SparseLoCoFragmentRequest, parse_model
from protocol.run_config import RunConfig
from protocol.transport import RpcServer, frame_bytes
from roles.worker.serving.replicas import StageReplicas
from roles.worker.sparseloco.service import SparseLoCoService
from roles.worker.sparseloco.transport import (
    FragmentInbox,
    FragmentTransport,
    RoundKey,
    StoreTransport,
    SwarmTransport,
)

_WORKER_ONLY = frozenset({"worker"})


class SparseLoCoEndpoint:
    def __init__(self, run: RunConfig, stage: int, service: SparseLoCoService, replicas: StageReplicas,
                 local_step):
        self.run = run
        self.stage = stage
        self.service = service
        self.replicas = replicas
        self.local_step = local_step
        self.inbox = FragmentInbox(service.max_bytes)

    def members(self) -> list[str]:
        """The stage's other replicas with a live progress record."""
        return list(self.replicas.ledger.peers.members)

    async def start(self, server: RpcServer) -> FragmentTransport:
        """Serve fragments (swarm transport) and return the transport the run config names."""
        slc = self.run.averaging.sparseloco
        if slc.transport == "store":
            return StoreTransport(self.run.sparseloco_store, self.run.run_id, self.stage, self.replicas.self_id,
                                  self.members, self.service.max_bytes)
        await server.add_handler(version.SPARSELOCO_FRAGMENT, self.serve, roles=_WORKER_ONLY)
        return SwarmTransport(self.replicas.self_id, self.inbox, self.push, self.members)

    async def push(self, peer: str, key: RoundKey, data: bytes, deadline: float) -> int:
        request = SparseLoCoFragmentRequest(stage=self.stage, round=key.round, fragment=key.fragment, data=data)
        await self.replicas.client.request(await self.replicas.peer(peer), version.SPARSELOCO_FRAGMENT, request,
                                           SparseLoCoFragmentReply, timeout_s=max(0.1, deadline - time.monotonic()))
        return frame_bytes(request)

    async def serve(self, peer_id, body: dict) -> SparseLoCoFragmentReply:
        request = parse_model(SparseLoCoFragmentRequest, body)
        if request.stage != self.stage:
            raise ProtocolError(f"this worker serves stage {self.stage}, not {request.stage}", ErrorCode.WRONG_STAGE)
        peer = peer_id.to_base58()
        if not await self.replicas.is_member(peer):
            raise ProtocolError("only a replica of this stage with a progress record may send fragments",
                                ErrorCode.NOT_READY)
        self.inbox.newest = max(self.inbox.newest, self.local_step())
        self.inbox.put(peer, RoundKey(request.round, request.fragment), request.data,
                       self.run.averaging.sparseloco.inner_steps)
        return SparseLoCoFragmentReply()
