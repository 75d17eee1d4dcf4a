"""Chunks and fragments of a stage's flat parameter vector (roles/worker/layout.py order).

SparseLoCo keeps the top k coordinates of each chunk of each tensor, so a chunk never crosses a
tensor: a tensor of n elements is ceil(n / C) chunks, the last one short. A short chunk keeps
proportionally fewer coordinates (at least one), so the density is the same everywhere.

Streaming exchanges the parameters in P fragments, contiguous runs of whole chunks of about equal
size, one captured after every floor(H / P) inner steps of a cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from roles.worker.layout import FlatLayout


@dataclass(frozen=True)
class ChunkRun:
    """`count` consecutive chunks of `length` elements each, starting at flat offset `start`:
    the full chunks of one tensor, or its short last chunk (count 1)."""

    start: int
    length: int
    count: int
    k: int

    @property
    def numel(self) -> int:
        return self.length * self.count


@dataclass(frozen=True)
class Fragment:
    """One fragment: flat elements [start, end), cut into chunk runs (offsets relative to `start`)."""

    index: int
    start: int
    end: int
    runs: tuple[ChunkRun, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def chunks(self) -> int:
        return sum(r.count for r in self.runs)

    @property
    def kept(self) -> int:
        """Coordinates this fragment sends per exchange."""
        return sum(r.k * r.count for r in self.runs)


def chunk_k(length: int, chunk_size: int, topk: int) -> int:
    """Coordinates kept in a chunk of `length` elements: topk for a full one, the same share (at
    least one) for a short one."""
    return min(length, max(1, math.ceil(topk * length / chunk_size)))


def _tensor_runs(offset: int, numel: int, chunk_size: int, topk: int) -> list[ChunkRun]:
    runs = []
    full, rest = divmod(numel, chunk_size)
    if full:
        runs.append(ChunkRun(offset, chunk_size, full, min(topk, chunk_size)))
    if rest:
        runs.append(ChunkRun(offset + full * chunk_size, rest, 1, chunk_k(rest, chunk_size, topk)))
    return runs


def plan_fragments(layout: FlatLayout, *, chunk_size: int, topk: int, fragments: int) -> list[Fragment]:
    """Cut the layout into chunks and the chunks into `fragments` contiguous fragments of about equal
    element count (every fragment gets at least one chunk; fewer fragments if there are fewer chunks)."""
    singles: list[ChunkRun] = []
    for i, shape in enumerate(layout.shapes):
        for run in _tensor_runs(layout.offsets[i], math.prod(shape), chunk_size, topk):
            singles.extend(ChunkRun(run.start + j * run.length, run.length, 1, run.k) for j in range(run.count))
    total = layout.numel
    parts: list[list[ChunkRun]] = [[] for _ in range(max(1, min(fragments, len(singles))))]
    for chunk in singles:
        # the fragment whose share of the vector this chunk's midpoint falls in
        f = min(len(parts) - 1, (2 * chunk.start + chunk.length) * len(parts) // (2 * total))
        parts[f].append(chunk)
    parts = [p for p in parts if p]
    out = []
    for index, chunks in enumerate(parts):
        start, end = chunks[0].start, chunks[-1].start + chunks[-1].length
        out.append(Fragment(index, start, end, tuple(_merge(chunks, start))))
    return out


def _merge(chunks: list[ChunkRun], base: int) -> list[ChunkRun]:
    """Consecutive single chunks of one length and k become one run (offsets relative to `base`)."""
    runs: list[ChunkRun] = []
    for c in chunks:
        last = runs[-1] if runs else None
        if last is not None and last.length == c.length and last.k == c.k \
                and last.start + last.numel == c.start - base:
            runs[-1] = ChunkRun(last.start, last.length, last.count + 1, last.k)
        else:
            runs.append(ChunkRun(c.start - base, c.length, 1, c.k))
    return runs


def capture_offset(fragment: int, fragments: int, inner_steps: int) -> int:
    """The step of the H-step cycle (1..H; H is the cycle's last) after which `fragment` is captured:
    (f + 1) * floor(H / P), so fragment P - 1 closes the cycle when P divides H."""
    return (fragment + 1) * (inner_steps // fragments)


def fragment_due(step: int, fragments: int, inner_steps: int) -> list[int]:
    """The fragments captured after stage step `step` (the count of steps taken, 1-based)."""
    if step <= 0:
        return []
    at = step % inner_steps or inner_steps
    return [f for f in range(fragments) if capture_offset(f, fragments, inner_steps) == at]


def flat_view(tensor: torch.Tensor, run: ChunkRun) -> torch.Tensor:
    """The run's chunks of a fragment-sized vector as a [count, length] view."""
    return tensor[run.start:run.start + run.numel].view(run.count, run.length)
