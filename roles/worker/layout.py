"""A stage's trainable tensors addressed as one flat float32 vector, without concatenating them.

SPARTA averages a set of coordinates of "the parameter vector" [report 4.2]; the worker keeps its
parameters as separate master tensors (the optimizer's CPU copies), and a flat copy would double
their memory. `FlatLayout` maps flat indices to (tensor, local index) pairs instead, so a round
gathers its index set straight from the master tensors and adds the averaged delta back into
them, and the state transfer reads and writes contiguous flat ranges.

The layout's digest covers the tensors' names and shapes: two replicas may exchange coordinates
only if they agree on it.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


class ParameterStore(Protocol):
    """The optimizer as averaging, checkpoints and state transfer see it (StageOptimizer is one):
    float32 master tensors in layout order, edited under `lock`, then pushed to the device."""

    lock: threading.RLock

    @property
    def master_params(self) -> Sequence[torch.Tensor]: ...

    def push_master_to_device(self) -> None: ...


@dataclass(frozen=True)
class Piece:
    """The part of a sorted flat index set that falls into tensor `tensor`: positions
    `[start, end)` of the set, at `local` indices of that tensor's flattened view."""

    tensor: int
    start: int
    end: int
    local: torch.Tensor


class FlatLayout:
    """Names, shapes and flat offsets of a stage's trainable tensors, in model order."""

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]]):
        if len(names) != len(shapes) or not names:
            raise ValueError("a layout needs one name per shape and at least one tensor")
        self.names = list(names)
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        sizes = [math.prod(shape) for shape in self.shapes]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        self.offsets = offsets
        self._offsets_tensor = torch.tensor(offsets, dtype=torch.int64)
        self.numel = offsets[-1]
        described = json.dumps([[name, list(shape)] for name, shape in zip(self.names, self.shapes)])
        self.digest = hashlib.sha256(f"agora-layout-v1:{described}".encode()).hexdigest()[:32]

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> FlatLayout:
        """The layout of a module's trainable parameters, in `parameters()` order (the order the
        optimizer keeps its master copies in)."""
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        return cls([name for name, _ in named], [tuple(p.shape) for _, p in named])

    @classmethod
    def of_stage(cls, model: torch.nn.Module) -> FlatLayout:
        """The layout a worker averages: the model's averaged-only payload (a surrogate's, none
        for a transformer stage) first, then its trainable parameters as in `of_module`."""
        payload = list(model.averaged_payload()) if hasattr(model, "averaged_payload") else []
        named = [*payload, *((name, p) for name, p in model.named_parameters() if p.requires_grad)]
        return cls([name for name, _ in named], [tuple(t.shape) for _, t in named])

    def check(self, tensors: Sequence[torch.Tensor]) -> None:
        """Raise ValueError unless `tensors` are float32, contiguous and shaped as this layout."""
        if len(tensors) != len(self.shapes):
            raise ValueError(f"layout has {len(self.shapes)} tensors, got {len(tensors)}")
        for name, shape, tensor in zip(self.names, self.shapes, tensors):
            if tuple(tensor.shape) != shape or tensor.dtype != torch.float32 or not tensor.is_contiguous():
                raise ValueError(f"{name}: expected contiguous float32 {shape}, got {tensor.dtype} "
                                 f"{tuple(tensor.shape)}")

    def split(self, sorted_indices: torch.Tensor) -> list[Piece]:
        """Cut a sorted set of flat indices at tensor boundaries."""
        bounds = torch.searchsorted(sorted_indices, self._offsets_tensor).tolist()
        pieces = []
        for i in range(len(self.shapes)):
            start, end = bounds[i], bounds[i + 1]
            if end > start:
                # The first tensor's local indices are a view, not a copy: for a surrogate's payload
                # that saves a second int64 vector as long as the averaged round.
                local = sorted_indices[start:end]
                pieces.append(Piece(i, start, end, local - self.offsets[i] if self.offsets[i] else local))
        return pieces

    @staticmethod
    @torch.no_grad()
    def gather(tensors: Sequence[torch.Tensor], pieces: Sequence[Piece], out: torch.Tensor) -> None:
        """out[k] = flat(tensors)[index k of the set] for every position of the pieces."""
        for piece in pieces:
            torch.index_select(tensors[piece.tensor].view(-1), 0, piece.local, out=out[piece.start:piece.end])

    @staticmethod
    @torch.no_grad()
    def add_(tensors: Sequence[torch.Tensor], pieces: Sequence[Piece], delta: torch.Tensor) -> None:
        """flat(tensors)[index k of the set] += delta[k], in place."""
        for piece in pieces:
            tensors[piece.tensor].view(-1).index_add_(0, piece.local, delta[piece.start:piece.end])

    def _ranges(self, start: int, count: int):
        if start < 0 or count < 0 or start + count > self.numel:
            raise ValueError(f"range [{start}, {start + count}) is outside [0, {self.numel})")
        end = start + count
        for i in range(len(self.shapes)):
            lo, hi = max(start, self.offsets[i]), min(end, self.offsets[i + 1])
            if hi > lo:
                yield i, lo - self.offsets[i], hi - self.offsets[i], lo - start

    @torch.no_grad()
    def read(self, tensors: Sequence[torch.Tensor], start: int, count: int) -> torch.Tensor:
        """A copy of flat elements `[start, start + count)`."""
        out = torch.empty(count, dtype=torch.float32)
        for i, lo, hi, at in self._ranges(start, count):
            out[at:at + hi - lo].copy_(tensors[i].view(-1)[lo:hi])
        return out

    @torch.no_grad()
    def write(self, tensors: Sequence[torch.Tensor], start: int, data: torch.Tensor) -> None:
        """Overwrite flat elements `[start, start + len(data))` with `data`."""
        for i, lo, hi, at in self._ranges(start, data.numel()):
            tensors[i].view(-1)[lo:hi].copy_(data[at:at + hi - lo])
