"""SparseLoCo's state per replica and the outer step [Sarfi et al. 2025, Crucible].

    Delta_r = anchor - theta_r                    the pseudo-gradient after H inner steps
    e_r     = beta * e_r + Delta_r               error feedback stands in for outer momentum
    C_r     = Q(TopK_chunk(e_r));  e_r -= C_r     what is sent; the rest stays for a later round
    anchor  = anchor - alpha * mean_r(C_r)        the new consensus, the same bits on every replica
    theta_r = anchor + (theta_r now - theta_r at capture)   (the drift of the tau overlapped steps)

The anchor is the consensus the replicas agree on; they stay equal because every replica applies
the same fragments, added in sender order, to the same anchor. A digest of the anchor travels with
every fragment, so a replica that parted from the others (it missed a fragment the others applied)
is found and reloads its stage's state. Per fragment, one capture waits for its apply: the next
capture of a fragment comes a whole cycle later.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from roles.worker.sparseloco.chunks import Fragment
from roles.worker.sparseloco.codec import Compressed, compress, decompress


def anchor_digest(vector: torch.Tensor) -> str:
    """16 hex characters naming a fragment's anchor bit for bit."""
    return hashlib.blake2b(vector.contiguous().numpy().tobytes(), digest_size=8).hexdigest()


@dataclass
class Capture:
    """One fragment's send, kept until its aggregate is applied."""

    round: int
    fragment: Fragment
    own: Compressed
    own_norm: float
    anchor: str
    weights: torch.Tensor
    """The fragment's weights when captured, to carry the drift of the overlapped steps over."""


@dataclass
class Applied:
    """What applying one round's aggregate did."""

    round: int
    fragment: int
    senders: tuple[str, ...]
    update_norm: float
    anchor: str


@dataclass
class SparseLoCoState:
    """The consensus anchor and the error-feedback buffer of one replica, both flat float32 in
    layout order. A joiner takes the anchor from its donor and starts with an empty buffer."""

    anchor: torch.Tensor
    error: torch.Tensor
    rounds_applied: int = 0
    pending: dict[int, Capture] = field(default_factory=dict)
    """Captures waiting for their aggregate, by fragment index."""

    @classmethod
    def starting_at(cls, weights: torch.Tensor) -> SparseLoCoState:
        return cls(anchor=weights.detach().clone(), error=torch.zeros_like(weights))

    @torch.no_grad()
    def capture(self, round_id: int, fragment: Fragment, weights: torch.Tensor, *, beta: float,
                bits: int) -> Capture:
        """Fold this replica's pseudo-gradient for `fragment` (its weights now: `weights`) into the
        error buffer, take what is sent out of it, and remember the capture."""
        lo, hi = fragment.start, fragment.end
        anchor = self.anchor[lo:hi]
        error = self.error[lo:hi]
        error.mul_(beta).add_(anchor).sub_(weights)
        own = compress(error, fragment, bits)
        sent = decompress(own, fragment)
        error.sub_(sent)
        cap = Capture(round_id, fragment, own, float(sent.norm()), anchor_digest(anchor), weights.clone())
        self.pending[fragment.index] = cap
        return cap

    @torch.no_grad()
    def apply(self, fragment: int, contributions: dict[str, Compressed], weights_now: torch.Tensor, *,
              alpha: float) -> tuple[torch.Tensor, Applied]:
        """The fragment's new weights: the anchor moved by the mean of `contributions` (this replica's
        own among them, by its peer id), plus the local drift since the capture. The anchor moves too."""
        cap = self.pending.pop(fragment)
        frag = cap.fragment
        lo, hi = frag.start, frag.end
        total = torch.zeros(frag.numel, dtype=torch.float32)
        for sender in sorted(contributions):
            decompress(contributions[sender], frag, out=total)
        update = total.div_(len(contributions)).mul_(alpha)
        anchor = self.anchor[lo:hi]
        anchor.sub_(update)
        new_weights = anchor + (weights_now - cap.weights)
        self.rounds_applied += 1
        return new_weights, Applied(cap.round, fragment, tuple(sorted(contributions)), float(update.norm()),
                                    anchor_digest(anchor))

    def reset(self, weights: torch.Tensor, anchor: Optional[torch.Tensor] = None) -> None:
        """Start over from a loaded state: its anchor (or the weights), an empty error buffer."""
        self.anchor.copy_(weights if anchor is None else anchor)
        self.error.zero_()
        self.pending.clear()

