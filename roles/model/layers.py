"""Llama-style decoder block whose residual writes are confined to span(U_k) [report 4.1].

The attention output and MLP down projections are reparameterized as W = Z U_k^T (eq. 3): only Z
is trained, U_k is a fixed buffer, so every block adds a vector of span(U_k) to the residual
stream and a stage boundary can carry k coordinates instead of d values. The Z-product runs in
the compute dtype; the expansion by U_k^T runs in U_k's dtype (float32) with autocast off, which
keeps the residual stream inside the subspace to float32 precision even when blocks compute in
bfloat16, whether through bfloat16 parameters or a worker's autocast.

Parameters are created uninitialized; the owning stage initializes them from its own seeded
generator (`reset_parameters`), so construction never touches the global RNG.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol.run_config import ModelConfig
from roles.model.subspace import without_autocast


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in at least float32, returned in the weight's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        with without_autocast(x):
            wide = x.to(torch.promote_types(x.dtype, torch.float32))
            normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
            return (normed * self.weight.to(wide.dtype)).to(self.weight.dtype)


class DenseLinear(nn.Module):
    """Bias-free `x @ W^T` with `W` [out, in]; like `nn.Linear` but without its RNG-driven init."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        with torch.no_grad():
            self.weight.normal_(0.0, std, generator=generator)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class SubspaceLinear(nn.Module):
    """Projection `x @ Z @ U_k^T` whose output rows lie in span(U_k) by construction (eq. 3).

    `z` [in_features, k] is the trainable factor; `basis` (U_k) is a non-persistent buffer, so it
    is neither trained nor saved: every node regenerates it from the run's seed.
    """

    def __init__(self, in_features: int, basis: Tensor):
        super().__init__()
        self.z = nn.Parameter(torch.empty(in_features, basis.shape[1]))
        self.register_buffer("basis", basis, persistent=False)

    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        with torch.no_grad():
            self.z.normal_(0.0, std, generator=generator)

    def forward(self, x: Tensor) -> Tensor:
        coords = x @ self.z
        with without_autocast(coords):
            return coords.to(self.basis.dtype) @ self.basis.T


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin, each [seq_len, head_dim], for rotate-half rotary embedding. Derived in float64
    so that every device rotates by the same angles."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate [B, H, T, Dh] queries or keys by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _output_projection(in_features: int, config: ModelConfig, basis: Tensor, full_rank: bool):
    if full_rank:
        return DenseLinear(in_features, config.d_model)
    return SubspaceLinear(in_features, basis)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions and a subspace output projection."""

    def __init__(self, config: ModelConfig, basis: Tensor, full_rank: bool):
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.d_model // config.n_heads
        self.rope_theta = config.rope_theta
        self.qkv_proj = DenseLinear(config.d_model, 3 * config.d_model)
        self.out_proj = _output_projection(config.d_model, config, basis, full_rank)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq_len, width = x.shape
        qkv = self.qkv_proj(x).view(batch, seq_len, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        cos, sin = rotary_tables(seq_len, self.head_dim, self.rope_theta, x.device, x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(attended.transpose(1, 2).reshape(batch, seq_len, width))


class SwiGLU(nn.Module):
    """Gated MLP `down(silu(gate(x)) * up(x))` with a subspace down projection."""

    def __init__(self, config: ModelConfig, basis: Tensor, full_rank: bool):
        super().__init__()
        self.gate_proj = DenseLinear(config.d_model, config.ffn_dim)
        self.up_proj = DenseLinear(config.d_model, config.ffn_dim)
        self.down_proj = _output_projection(config.ffn_dim, config, basis, full_rank)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block. The residual stream `h` stays in its own (float32 or wider) dtype;
    the block computes in its parameters' dtype and adds its outputs back in `h`'s dtype.

    `full_rank` swaps both output projections for ordinary [in, d] matrices; only tail blocks may
    do so, because no boundary follows them.
    """

    def __init__(self, config: ModelConfig, U: Tensor, full_rank: bool):
        super().__init__()
        self.full_rank = full_rank
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, U, full_rank)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config, U, full_rank)

    def reset_parameters(self, generator: torch.Generator, std: float, out_std: float) -> None:
        """Initialize in a fixed order so that seeded replicas start bit-identical; output
        projections get the smaller `out_std` to keep early residual updates small."""
        self.attn_norm.reset_parameters()
        self.attn.qkv_proj.reset_parameters(generator, std)
        self.attn.out_proj.reset_parameters(generator, out_std)
        self.mlp_norm.reset_parameters()
        self.mlp.gate_proj.reset_parameters(generator, std)
        self.mlp.up_proj.reset_parameters(generator, std)
        self.mlp.down_proj.reset_parameters(generator, out_std)

    def forward(self, h: Tensor) -> Tensor:
        h = h + self.attn(self.attn_norm(h)).to(h.dtype)
        return h + self.mlp(self.mlp_norm(h)).to(h.dtype)
