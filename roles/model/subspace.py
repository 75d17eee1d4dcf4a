"""The shared subspace that makes stage boundaries lossless: U_k, the fixed token embedding, and
the compress/reconstruct pair of eq. (2) in [report 4.1].

Every stage of a run must derive the same U_k and fixed embedding from `subspace_seed` alone, on
whatever device it computes, so both are drawn from a CPU `torch.Generator` in float64 and only
then rounded to the requested dtype: ulp-level differences between CPU math libraries vanish in
that rounding, and `fingerprint` lets nodes confirm they agree. Rotary attention adds no
positional embedding, so the PE term of eq. (2) is zero here.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
from torch import Tensor

# Rows of the fixed embedding drawn per generator call; bounds the float64 scratch to a few MB
# even for a 128k x 5120 table. Part of the derivation: changing it changes every value.
_EMBEDDING_CHUNK_ROWS = 1024


def _derived_seed(seed: int, purpose: str) -> int:
    """Independent generator streams for U_k and the fixed embedding from one run seed."""
    digest = hashlib.sha256(f"agora/subspace/{purpose}/{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def subspace_basis(
    d_model: int,
    rank: int,
    seed: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """U_k: a [d_model, rank] matrix with orthonormal columns, identical on every node.

    QR of a seeded Gaussian, with column signs fixed by diag(R) > 0 so the factorization is unique
    and does not depend on the LAPACK build's sign convention.
    """
    if not 0 < rank <= d_model:
        raise ValueError(f"rank {rank} must lie in 1..d_model ({d_model})")
    generator = torch.Generator(device="cpu").manual_seed(_derived_seed(seed, "basis"))
    gaussian = torch.randn(d_model, rank, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian, mode="reduced")
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs).to(device=device, dtype=dtype)


def fixed_token_embedding(
    vocab_size: int,
    d_model: int,
    seed: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """T_fixed: a [vocab_size, d_model] untrained embedding with entries ~ N(0, 1/d_model), so a
    row has norm ~1. It gives every token a distinct full-width vector that no boundary has to
    carry, because both sides of the boundary can regenerate it."""
    out = torch.empty(vocab_size, d_model, dtype=dtype)
    generator = torch.Generator(device="cpu").manual_seed(_derived_seed(seed, "token-embedding"))
    scale = d_model**-0.5
    for start in range(0, vocab_size, _EMBEDDING_CHUNK_ROWS):
        rows = min(_EMBEDDING_CHUNK_ROWS, vocab_size - start)
        chunk = torch.randn(rows, d_model, generator=generator, dtype=torch.float64)
        out[start : start + rows] = (chunk * scale).to(dtype)
    return out.to(device=device)


def without_autocast(tensor: Tensor) -> torch.autocast:
    """A context that turns autocast off on `tensor`'s device: boundary arithmetic and the
    expansion by U_k^T must keep full precision even when a worker runs blocks under autocast."""
    return torch.autocast(device_type=tensor.device.type, enabled=False)


def compress(hidden: Tensor, tokens: Tensor, fixed_emb: Optional[Tensor], U: Tensor) -> Tensor:
    """Boundary coordinates [B, T, k] = (hidden - T_fixed[tokens]) @ U_k, eq. (2).

    Lossless when `hidden - T_fixed[tokens]` lies in span(U_k) up to what the receiving stage
    regenerates itself, which the reparameterized model guarantees. `fixed_emb` None: the
    construction has no fixed table (stage anchors, orthogonal to U_k, vanish in the projection).
    Computed in `hidden`'s dtype, with autocast off.
    """
    with without_autocast(hidden):
        if fixed_emb is not None:
            hidden = hidden - fixed_emb[tokens].to(hidden.dtype)
        return hidden @ U.to(hidden.dtype)


def reconstruct(coords: Tensor, tokens: Tensor, fixed_emb: Optional[Tensor], U: Tensor) -> Tensor:
    """The residual stream [B, T, d] = T_fixed[tokens] + coords @ U_k^T, inverse of `compress`
    (no T_fixed term when `fixed_emb` is None); computed in `coords`' dtype, with autocast off."""
    with without_autocast(coords):
        stream = coords @ U.to(coords.dtype).T
        if fixed_emb is not None:
            stream = fixed_emb[tokens].to(coords.dtype) + stream
        return stream


def fingerprint(tensor: Tensor) -> str:
    """Short hex digest of a tensor's dtype, shape and bytes, for checking that nodes derived the
    same U_k or fixed embedding without shipping either."""
    flat = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{flat.dtype}:{tuple(flat.shape)}:".encode())
    digest.update(flat.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
