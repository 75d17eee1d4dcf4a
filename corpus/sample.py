"""One training sample, as every data source hands it to the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Sample"]


@dataclass(frozen=True)
class Sample:
    """`seq_len` token ids (int64) and an id no other trainer of the run uses; from a prepared
    corpus also its ordinal, its place in the trainer's walk through the data."""

    sample_id: str
    tokens: torch.Tensor
    ordinal: Optional[int] = None
