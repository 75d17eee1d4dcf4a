"""Which parts a reducer leaves out of an average, so one replica sending garbage cannot poison a
round [report 5.7]: the round completes with the others, and the round report names the sender.

The round buffer holds weight values (rounds.py), and replicas of a stage stay close to each
other, so the same part of every honest replica has about the same norm (a part is a few thousand
randomly chosen coordinates of the stage, index_sets.py). A part is rejected when

- its values are not all finite, or not floating point;
- its sender's weight is not finite or outside [0, max_sender_weight] (the sender chooses it;
  0 is what a replica in a sync phase sends);
- its norm is more than `max_norm_ratio` times above or below the reference: the reducer's own
  part when it sends one (it trusts itself), else the median of the others. A sender with weight 0
  adds nothing to the average, so its norm is not held against it: a joiner in weight sync still
  gets the average it needs.

A part of the wrong shape never gets here: protocol/hivemind_adapter.py `HoldingReducer` rejects
it first (it would be broadcast over the whole part).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from protocol.hivemind_adapter import HeldPart


@dataclass(frozen=True)
class PartScreen:
    max_norm_ratio: float
    max_sender_weight: float

    def __call__(self, held: Sequence[HeldPart], trusted: Optional[int]) -> dict[int, str]:
        """{sender index: reason} for the parts of one part index to leave out; `trusted` is the
        reducer's own sender index (its part is never rejected)."""
        rejected: dict[int, str] = {}
        norms: dict[int, float] = {}
        for part in held:
            if part.sender == trusted:
                norms[part.sender] = _norm(part.tensor)
                continue
            if not math.isfinite(part.weight) or not 0.0 <= part.weight <= self.max_sender_weight:
                rejected[part.sender] = f"weight {part.weight!r} outside [0, {self.max_sender_weight:g}]"
            elif not part.tensor.is_floating_point():
                rejected[part.sender] = f"values of type {part.tensor.dtype}"
            elif not bool(torch.isfinite(part.tensor).all()):
                rejected[part.sender] = "values that are not finite"
            else:
                norms[part.sender] = _norm(part.tensor)
        reference = norms.get(trusted) if trusted is not None else None
        if reference is None or not math.isfinite(reference):
            others = [norm for sender, norm in norms.items() if sender != trusted]
            reference = statistics.median(others) if others else None
        if reference is None:
            return rejected
        weights = {part.sender: part.weight for part in held}
        for sender, norm in norms.items():
            if sender == trusted or weights[sender] == 0.0:
                continue
            if not _within(norm, reference, self.max_norm_ratio):
                ratio = f"{norm / reference:.3g}x" if reference > 0 else "nonzero against 0"
                rejected[sender] = f"norm {norm:.3g}, {ratio} the reference {reference:.3g}"
        return rejected


def _norm(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor, dtype=torch.float64))


def _within(norm: float, reference: float, ratio: float) -> bool:
    if not math.isfinite(norm):
        return False
    return reference / ratio <= norm <= reference * ratio
