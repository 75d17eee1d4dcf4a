"""The surrogate stage [report 3.5.1]: a stand-in for one pipeline stage that communicates like the
real one and computes almost nothing.

It keeps the real stage's interface and traffic: boundary coordinates [B, T, k] in float32 with
the token ids beside them, and an averaged vector with as many values per round as the real stage
(`roles/model/surrogate_sizes.py`). Compute is `layers` residual layers k -> width -> k applied
per position, and the time a real stage would take is slept in the compute thread
(`SurrogateConfig.delay_s`: a per-batch cost plus a per-sample one), so queueing, coalescing and
the GIL behave as with real compute while the CPU stays free for a swarm of such nodes.

The tail's loss is cheap and still learnable: the mean squared error between its output at
position t and a fixed random code of token t+1 (a seeded vocab x k table, N(0, 1) entries), so
loss falls as the stages learn the data's bigram statistics, and fidelity-style comparisons work.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Literal

import torch
from torch import Tensor, nn

from protocol.run_config import RunConfig
from roles.model.stage import check_stage_inputs
from roles.model.surrogate_sizes import surrogate_payload_count

_INIT_STD = 0.02
_PAYLOAD_STD = 0.02


def _seed(run_seed: int, stage_index: int, purpose: str) -> int:
    digest = hashlib.sha256(f"agora/surrogate/{purpose}/{run_seed}/{stage_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SurrogateLayer(nn.Module):
    """x + W2 tanh(W1 x + b1) + b2 on the k coordinates of each position."""

    def __init__(self, rank: int, width: int):
        super().__init__()
        self.up = nn.Linear(rank, width)
        self.down = nn.Linear(width, rank)

    def reset_parameters(self, generator: torch.Generator) -> None:
        with torch.no_grad():
            self.up.weight.normal_(0.0, 1.0 / math.sqrt(self.up.in_features), generator=generator)
            self.down.weight.normal_(0.0, _INIT_STD, generator=generator)
            self.up.bias.zero_()
            self.down.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class SurrogateStage(nn.Module):
    """A surrogate of `run.stages[stage_index]`, built from a run whose `model.kind` is surrogate.

    Parameters are float32 whatever `run.dtype` says (they are few, and a CPU worker then shares
    its master weights with them). The payload is a plain float32 CPU tensor, not a parameter:
    no gradient, no AdamW moments, no device copy; the worker appends it to what it averages,
    checkpoints and transfers (`averaged_payload`).
    """

    def __init__(self, run: RunConfig, stage_index: int, device: torch.device | str = "cpu"):
        super().__init__()
        if run.model.kind != "surrogate" or run.surrogate is None:
            raise ValueError(f"run {run.run_id} is not a surrogate run (model.kind {run.model.kind})")
        model, self.settings = run.model, run.surrogate
        self.kind: Literal["head", "body", "tail"] = run.stage_kind(stage_index)
        self.stage_index = stage_index
        self.vocab_size = model.vocab_size
        self.subspace_rank = model.subspace_rank
        self.max_seq_len = model.max_seq_len
        generator = torch.Generator(device="cpu").manual_seed(_seed(run.seed, stage_index, "init"))
        if self.kind == "head":
            self.embedding = nn.Parameter(torch.empty(model.vocab_size, model.subspace_rank))
            with torch.no_grad():
                self.embedding.normal_(0.0, _INIT_STD, generator=generator)
        self.layers = nn.ModuleList(
            SurrogateLayer(model.subspace_rank, self.settings.width) for _ in range(self.settings.layers)
        )
        for layer in self.layers:
            layer.reset_parameters(generator)
        if self.kind == "tail":
            codes = torch.Generator(device="cpu").manual_seed(_seed(model.subspace_seed, 0, "codes"))
            self.register_buffer(
                "codes", torch.randn(model.vocab_size, model.subspace_rank, generator=codes), persistent=False
            )
        payload = torch.empty(surrogate_payload_count(run, stage_index), dtype=torch.float32)
        payload.normal_(0.0, _PAYLOAD_STD, generator=torch.Generator(device="cpu").manual_seed(
            _seed(run.seed, stage_index, "payload")))
        self.payload = payload
        self.to(device)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps; the payload is not among them."""
        return [param for param in self.parameters() if param.requires_grad]

    def averaged_payload(self) -> list[tuple[str, Tensor]]:
        """Averaged-only tensors, ahead of the trainable ones in the averaged vector."""
        return [("surrogate.payload", self.payload)] if self.payload.numel() else []

    def delay_s(self, batch: int, *, backward: bool) -> float:
        """Seconds a batch of `batch` samples sleeps in `forward`."""
        return self.settings.delay_s(batch, backward=backward)

    def forward(self, coords: Tensor | None, tokens: Tensor) -> Tensor:
        """Same contract as `StageModel.forward`: the head embeds `tokens` [B, T]; head and body
        return coordinates [B, T, k] in float32; the tail returns the per-sample loss [B].

        Sleeps the configured delay first: the backward delay when autograd records (a backward
        batch's recompute, or the tail's fused pass), the forward delay otherwise.
        """
        self._check_inputs(coords, tokens)
        delay = self.delay_s(tokens.shape[0], backward=torch.is_grad_enabled())
        if delay > 0:
            time.sleep(delay)
        hidden = self.embedding[tokens] if self.kind == "head" else coords.float()
        for layer in self.layers:
            hidden = layer(hidden)
        if self.kind == "tail":
            target = self.codes[tokens[:, 1:]]
            return (hidden[:, :-1].float() - target).pow(2).mean(dim=(1, 2))
        return hidden.float()

    def _check_inputs(self, coords: Tensor | None, tokens: Tensor) -> None:
        check_stage_inputs(self.kind, coords, tokens, max_seq_len=self.max_seq_len, subspace_rank=self.subspace_rank)
