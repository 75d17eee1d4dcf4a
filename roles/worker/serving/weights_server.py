"""`agora/v1/weights`: hand a trainer the parameters this worker computed with at one weight
version, in chunks, so that it can re-execute a disputed hop itself (roles/trainer/reexecution.py).

What is served is what the worker's replies name with their `weights` fingerprint: the parameters
the stage computes with (`optimizer.params`, in their own dtype), at exactly the version asked for:
the current weights if the worker is at that version, the copy of the previous version the
optimizer keeps for pinned backwards if that is the one (`keep_previous`), else nothing (NOT_KEPT).
Each chunk is read under the optimizer's lock and names the version and the fingerprint of the
whole set it was read from, so a caller notices weights that changed between two of its chunks.

A request is hostile input: it is validated, a chunk is bounded, and each peer has a budget of
bytes that refills over `window_s` (`budget_copies` copies of the stage per window): a trainer
referees a dispute with one copy per side, and a peer cannot make the worker stream its stage in a
loop. The budget's table is bounded too.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Callable, Optional, Sequence

import torch
from hivemind.p2p import PeerID

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import parse_model
from protocol.state_messages import MAX_WEIGHTS_CHUNK_ELEMENTS, WeightsReply, WeightsRequest
from roles.worker.serving.compute_stats import weights_fingerprint

BUDGET_COPIES = 4
"""Copies of the stage one peer may fetch per window (a dispute costs one)."""
WINDOW_S = 600.0
REQUEST_BYTES_MIN = 1 << 16
"""What any request costs against the budget at least, a description-only one too: each takes the
optimizer's lock to read a fingerprint, so none comes free in a loop."""
PEERS_TRACKED_MAX = 1024
"""Peers whose budget is remembered; the longest idle one is forgotten beyond this."""


class WeightsServer:
    """`optimizer` is the worker's StageOptimizer (params, previous, previous_version, local_step, lock)."""

    def __init__(self, optimizer, *, run_id: str, stage: int, serving: Callable[[], bool],
                 max_chunk_elements: int = MAX_WEIGHTS_CHUNK_ELEMENTS, budget_copies: float = BUDGET_COPIES,
                 window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.optimizer = optimizer
        self.run_id = run_id
        self.stage = stage
        self.serving = serving
        self.max_chunk_elements = max(1, min(max_chunk_elements, MAX_WEIGHTS_CHUNK_ELEMENTS))
        params = list(optimizer.params)
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        self.itemsize = params[0].element_size()
        self.capacity = budget_copies * max(self.numel * self.itemsize, REQUEST_BYTES_MIN)
        """Bytes a peer may fetch at once; it refills at `capacity / window_s` a second."""
        self.window_s = window_s
        self._clock = clock
        self._budgets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        """Peer -> (bytes left, when counted)."""
        self.counters: collections.Counter[str] = collections.Counter()

    def _charge(self, peer: str, nbytes: int) -> bool:
        now = self._clock()
        left, at = self._budgets.pop(peer, (self.capacity, now))
        left = min(self.capacity, left + (now - at) * self.capacity / self.window_s)
        granted = nbytes <= left
        self._budgets[peer] = (left - nbytes if granted else left, now)
        while len(self._budgets) > PEERS_TRACKED_MAX:
            self._budgets.popitem(last=False)
        return granted

    def _refuse(self, reason: str, message: str, code: ErrorCode) -> ProtocolError:
        self.counters[f"weights_refused_{reason}"] += 1
        return ProtocolError(message, code)

    def _read(self, version: int, offset: int, count: int) -> tuple[bytes, Optional[torch.Tensor]]:
        opt = self.optimizer
        with opt.lock:
            if opt.local_step == version:
                tensors = opt.params
            elif opt.previous is not None and opt.previous_version == version:
                tensors = opt.previous
            else:
                raise self._refuse("not_kept", f"this worker is at version {opt.local_step} and keeps no weights "
                                   f"of version {version}", ErrorCode.NOT_KEPT)
            return weights_fingerprint(tensors), (_flat_range(tensors, offset, count) if count else None)

    async def handle(self, peer_id: PeerID, body: dict) -> WeightsReply:
        request = parse_model(WeightsRequest, body)
        if request.stage != self.stage:
            raise self._refuse("wrong_stage", f"this worker serves stage {self.stage}, not {request.stage}",
                               ErrorCode.WRONG_STAGE)
        if not self.serving():
            raise self._refuse("not_ready", "this worker is not serving now (starting, leaving or in weight sync)",
                               ErrorCode.NOT_READY)
        if request.offset > self.numel:
            raise self._refuse("invalid", f"offset {request.offset} is past the stage's {self.numel} parameters",
                               ErrorCode.INVALID_REQUEST)
        count = min(request.count, self.max_chunk_elements, self.numel - request.offset)
        if not self._charge(peer_id.to_base58(), max(count * self.itemsize, REQUEST_BYTES_MIN)):
            raise self._refuse("budget", f"this peer fetched more than {self.capacity} bytes of weights in "
                               f"{self.window_s:.0f} s; retry later", ErrorCode.RATE_LIMITED)
        fingerprint, data = await asyncio.to_thread(self._read, request.version, request.offset, count)
        self.counters["weights_chunks_served"] += 1
        self.counters["weights_bytes_served"] += count * self.itemsize
        return WeightsReply(run_id=self.run_id, stage=self.stage, version=request.version, weights=fingerprint,
                            numel=self.numel, dtype=str(self.dtype).removeprefix("torch."), offset=request.offset,
                            data=data)


@torch.no_grad()
def _flat_range(tensors: Sequence[torch.Tensor], start: int, count: int) -> torch.Tensor:
    """A CPU copy of flat elements `[start, start + count)` of `tensors` taken end to end, in their dtype."""
    pieces, at = [], 0
    for tensor in tensors:
        n = tensor.numel()
        lo, hi = max(start, at), min(start + count, at + n)
        if hi > lo:
            pieces.append(tensor.detach().reshape(-1)[lo - at:hi - at].to("cpu", copy=True))
        at += n
    return torch.cat(pieces) if len(pieces) != 1 else pieces[0].contiguous()
