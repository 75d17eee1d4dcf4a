"""The index sets AsyncSPARTA averages: `segments` disjoint random subsets that tile the flat
parameter vector, one per round in a fixed rotation [report 4.2, 5.7].

Every replica must average the same coordinates, and nothing in hivemind checks that they do.
The sets are therefore a pure function of the run seed, the stage, the parameter
layout and the segment number: a keyed Feistel permutation of `[0, numel)` (integer arithmetic
only, so every process and platform computes the same bits), cut into `segments` contiguous runs
of permuted positions. Segment `s` is the image of positions `[s*n//S, (s+1)*n//S)`, so the
segments are disjoint and cover every parameter exactly once per `segments` rounds, and no
process ever materialises the whole permutation (a 100M-parameter stage would need 800 MB).

Each set is sorted (gathering sorted indices is several times faster than random ones) and
carries a digest of its actual contents, which peers compare: a replica whose digest differs is
kept out of the round instead of being averaged blindly.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from roles.worker.layout import FlatLayout, Piece

ALGORITHM = "agora-sparta-feistel-v1"
_MASK31 = (1 << 31) - 1
_FEISTEL_ROUNDS = 4


def _mix_(x: torch.Tensor, key: int, scratch: torch.Tensor) -> torch.Tensor:
    """A keyed integer hash of values below 2**31, in place. Products stay below 2**62, so int64
    never overflows and the result is exact everywhere."""
    x.bitwise_xor_(key).bitwise_and_(_MASK31)
    x.mul_(0x2545F491).bitwise_and_(_MASK31)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=scratch))
    x.mul_(0x5851F42D).bitwise_and_(_MASK31)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 13, out=scratch))


_CHUNK = 1 << 14  # elements hashed at a time: the dozens of passes of a Feistel stay in cache


class FeistelPermutation:
    """A seeded bijection of `[0, n)`: a Feistel network on the smallest number of bits that
    covers `n` (alternating halves, so an odd width works), with cycle-walking for values that
    land outside `[0, n)` (fewer than half of them, as `2**bits < 2n`)."""

    def __init__(self, n: int, key: bytes):
        if not 0 < n <= 1 << 62:
            raise ValueError(f"cannot permute {n} elements")
        self.n = n
        self.bits = max(2, (n - 1).bit_length())
        self.keys = [
            int.from_bytes(hashlib.blake2b(key + bytes([i]), digest_size=8).digest(), "little") & _MASK31
            for i in range(_FEISTEL_ROUNDS)
        ]

    def _encrypt(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._encrypt_chunk(chunk) for chunk in x.split(_CHUNK)]) if x.numel() else x.clone()

    def _encrypt_chunk(self, x: torch.Tensor) -> torch.Tensor:
        # (left, right) hold (bits - w, w) bits; each round maps them to (right, left ^ F(right)),
        # so the widths swap and any width split stays a bijection.
        w = self.bits // 2
        left, right = x >> w, x & ((1 << w) - 1)
        round_value, scratch = torch.empty_like(x), torch.empty_like(x)
        for key in self.keys:
            left_bits = self.bits - w
            round_value.copy_(right)
            _mix_(round_value, key, scratch).bitwise_and_((1 << left_bits) - 1)
            left, right, w = right, left.bitwise_xor_(round_value), left_bits
        return left.bitwise_left_shift_(w).bitwise_or_(right)

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        out = self._encrypt(positions.to(torch.int64))
        pending = torch.nonzero(out >= self.n).flatten()
        while pending.numel():  # terminates: the cycle through x < n returns below n
            values = self._encrypt(out[pending])
            out[pending] = values
            pending = pending[values >= self.n]
        return out


@dataclass(frozen=True)
class IndexSet:
    """One segment's sorted flat indices, cut at tensor boundaries, and their digest."""

    segment: int
    indices: torch.Tensor
    pieces: list[Piece]
    digest: str

    def __len__(self) -> int:
        return self.indices.numel()


class SegmentIndexSets:
    """Computes (and keeps the last few of) a stage's segment index sets; thread-safe, so the
    next round's set can be prepared in the background."""

    def __init__(self, layout: FlatLayout, segments: int, *, seed: int, stage: int, cache_size: int = 3):
        if segments < 1:
            raise ValueError("segments must be at least 1")
        self.layout = layout
        self.segments = segments
        self.numel = layout.numel
        self.buffer_size = math.ceil(self.numel / segments)
        """Length of the fixed-size round buffer: the largest segment (sizes differ by at most 1)."""
        self._key = f"{ALGORITHM}/{seed}/{stage}/{layout.digest}/{segments}".encode()
        self._permutation = FeistelPermutation(self.numel, self._key)
        self._cache: OrderedDict[int, IndexSet] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def bounds(self, segment: int) -> tuple[int, int]:
        """Positions of the permutation that make up `segment`."""
        if not 0 <= segment < self.segments:
            raise ValueError(f"segment {segment} is outside 0..{self.segments - 1}")
        return segment * self.numel // self.segments, (segment + 1) * self.numel // self.segments

    def cached(self, segment: int) -> Optional[IndexSet]:
        """The segment's index set if it is already computed, else None (never builds one)."""
        with self._lock:
            return self._cache.get(segment)

    def get(self, segment: int) -> IndexSet:
        with self._lock:
            cached = self._cache.get(segment)
            if cached is not None:
                self._cache.move_to_end(segment)
                return cached
        built = self._build(segment)
        with self._lock:
            self._cache[segment] = built
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return built

    def _build(self, segment: int) -> IndexSet:
        start, end = self.bounds(segment)
        if end - start == self.numel:
            # One segment covers every position, and the sorted image of a whole permutation is
            # the identity: skip the permutation and the sort (their transients are several times
            # the set's size, which is all of a surrogate stage's averaged vector [report 3.5.1]).
            indices = torch.arange(self.numel, dtype=torch.int64)
        else:
            indices, _ = torch.sort(self._permutation(torch.arange(start, end, dtype=torch.int64)))
        digest = hashlib.blake2b(digest_size=16)
        digest.update(self._key)
        digest.update(f"/{segment}/{end - start}/".encode())
        digest.update(indices.numpy().data)  # the buffer itself: no copy of a long set
        return IndexSet(segment, indices, self.layout.split(indices), digest.hexdigest())
