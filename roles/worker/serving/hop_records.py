"""What a worker keeps of its chained samples, and the `agora/v1/hop_record` handler that hands it
to the sample's trainer.

On the workers path (roles/worker/serving/chain.py) the trainer never sees a boundary's
coordinates or gradients, so it cannot spot-check a worker with what it sent and got, as it does
on its own path (roles/trainer/spot_checks.py). Each worker therefore keeps, for a short while,
the coordinates it received and passed on and the gradients it received back and sent back, each
with its signer's signature (protocol/messages.py SignedHop). A trainer that draws a hop of worker
W asks W's neighbours, never W: the worker before W says what it sent W, the one after W what it
got from W with W's signature (roles/trainer/chain_checks.py). W is asked nothing, so it cannot
tell which of its samples are checked, and it signed its results before anyone asked.

What is kept is bounded three ways, whichever bites first: samples (`max_samples`), bytes
(`max_bytes`, the tensors and a fixed overhead per record) and age (`max_age_s`); the oldest
sample goes first. A trainer asks right after the sample completed; a record it finds gone is a
check not made (`not_kept`), never a verdict.

A trainer may read only its own samples: their ids begin with its peer id's last 8 characters
(protocol/messages.py sample_owner_prefix), and the libp2p channel authenticates the caller. Any
other id, like an evicted one, is answered NOT_KEPT, so a caller learns nothing of others' samples.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from hivemind.p2p import PeerID

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import (
    HOP_RECORD_KINDS,
    HopRecordReply,
    HopRecordRequest,
    SignedHop,
    parse_model,
    sample_owner_prefix,
)

MAX_SAMPLES = 256
"""Chained samples kept at once: a few seconds of a busy worker, far more than a trainer's lanes
hold in flight between a sample's start and its checks."""
MAX_BYTES = 64 << 20
"""Bytes of kept tensors (and `RECORD_OVERHEAD_BYTES` a record) at once."""
MAX_AGE_S = 120.0
"""A record older than this is dropped: a trainer asks within seconds of the sample's end."""
RECORD_OVERHEAD_BYTES = 512
"""What a record costs beside its tensor: the signature, digests, ids and Python's objects."""


@dataclass(frozen=True)
class HopRecord:
    """One kept tensor of a chained sample and its signer's signature over it."""

    tensor: torch.Tensor
    signed: Optional[SignedHop]
    at: float
    """When it was kept (monotonic)."""

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size() + RECORD_OVERHEAD_BYTES


class HopRecords:
    """Sample id -> its kept records, by kind (HOP_RECORD_KINDS); bounded by count, bytes and age."""

    def __init__(self, *, max_samples: int = MAX_SAMPLES, max_bytes: int = MAX_BYTES, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.max_samples = max_samples
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._clock = clock
        self._samples: collections.OrderedDict[str, dict[str, HopRecord]] = collections.OrderedDict()
        """Oldest first (by the sample's first record)."""
        self.nbytes = 0
        self.counters: collections.Counter[str] = collections.Counter()
        """kept, evicted (records dropped for room or age), served, not_kept (asked, not held)."""

    def __len__(self) -> int:
        return len(self._samples)

    def keep(self, sample_id: str, which: str, tensor: Optional[torch.Tensor], signed: Optional[SignedHop]) -> None:
        """Keep `tensor` as the sample's `which` record, replacing an earlier one of that kind (a
        sample retried on another candidate passes the same coordinates on again)."""
        assert which in HOP_RECORD_KINDS, which
        if tensor is None:
            return
        tensor = tensor.detach()
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a row of a batch: keep its own bytes, not the whole batch's
        record = HopRecord(tensor, signed, self._clock())
        if record.nbytes > self.max_bytes:
            return
        records = self._samples.get(sample_id)
        if records is None:
            records = self._samples[sample_id] = {}
        old = records.pop(which, None)
        if old is not None:
            self.nbytes -= old.nbytes
        records[which] = record
        self.nbytes += record.nbytes
        self.counters["kept"] += 1
        self._evict(keep=sample_id)

    def get(self, sample_id: str, which: str) -> Optional[HopRecord]:
        self._evict()
        return self._samples.get(sample_id, {}).get(which)

    def _evict(self, keep: Optional[str] = None) -> None:
        """Drop the oldest samples while over a bound (never `keep`, the one just added, for count
        or bytes: it fits by itself), and every sample whose first record is too old."""
        oldest_kept = self._clock() - self.max_age_s
        while self._samples:
            sample_id, records = next(iter(self._samples.items()))
            first = min(record.at for record in records.values())
            over = len(self._samples) > self.max_samples or self.nbytes > self.max_bytes
            if not (first < oldest_kept or (over and sample_id != keep)):
                break
            del self._samples[sample_id]
            self.nbytes -= sum(record.nbytes for record in records.values())
            self.counters["evicted"] += len(records)

    async def handle(self, peer_id: PeerID, body: dict, *, stage: int, run_id: str) -> HopRecordReply:
        """`agora/v1/hop_record`: one kept record of one of the caller's chained samples."""
        request = parse_model(HopRecordRequest, body)
        if request.run_id != run_id:
            raise ProtocolError(f"this worker serves run {run_id!r}, not {request.run_id!r}",
                                ErrorCode.INVALID_REQUEST)
        if request.stage != stage:
            raise ProtocolError(f"this worker serves stage {stage}, not {request.stage}", ErrorCode.WRONG_STAGE)
        record = None
        if request.sample_id.startswith(sample_owner_prefix(peer_id.to_base58())):
            record = self.get(request.sample_id, request.which)
        if record is None:
            self.counters["not_kept"] += 1
            raise ProtocolError(f"no {request.which} record of sample {request.sample_id[:64]!r} is kept here "
                                f"(kept {self.max_age_s:.0f} s at most)", ErrorCode.NOT_KEPT)
        self.counters["served"] += 1
        return HopRecordReply(tensor=record.tensor, signed=record.signed)
