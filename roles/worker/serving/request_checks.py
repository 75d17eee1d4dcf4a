"""The checks every request passes before it is queued [report 3.3.1.2], so that one malformed
request can never spoil a batch: the stage it names, its tokens' dtype, shape and id range, its
coordinates' and gradients' shape, dtype and finiteness, and the fields each stage kind takes or
refuses. They run on the event loop; a failure is a ProtocolError the handler sends back.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import BackwardRequest, EvaluateRequest, ForwardRequest, RetractRequest

_COORD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RequestChecks:
    """The checks of one stage's requests; `local_step` reads the stage's open step (a backward's
    step tag may not lie implausibly far beyond it)."""

    def __init__(self, *, stage: int, kind: str, vocab_size: int, max_seq_len: int, rank: int,
                 local_step: Callable[[], int]):
        self.stage = stage
        self.kind = kind
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.rank = rank
        self.local_step = local_step

    def check_forward(self, request: ForwardRequest) -> None:
        if self.kind == "tail":
            raise ProtocolError("the tail fuses loss forward and backward: send a backward request",
                                ErrorCode.INVALID_REQUEST)
        self._check_common(request.stage, request.tokens, request.coords)

    def check_backward(self, request: BackwardRequest) -> None:
        self._check_backward_inputs(request)
        if self.kind == "tail" and request.step is not None:
            raise ProtocolError("the tail tags samples with their step itself; step must be absent",
                                ErrorCode.INVALID_REQUEST)
        if request.step is not None and request.step > self.local_step() + 1_000_000:
            raise ProtocolError(f"step {request.step} is implausibly far ahead of this stage's "
                                f"{self.local_step()}", ErrorCode.INVALID_REQUEST)

    def check_retract(self, request: RetractRequest) -> None:
        """A retraction brings what the sample's backward brought here."""
        self._check_backward_inputs(request)

    def _check_backward_inputs(self, request: BackwardRequest | RetractRequest) -> None:
        """The tail's input, or a head's or body's input and output gradient, shaped for this
        stage and finite (the tail computes its own loss: no output gradient)."""
        seq_len = self._check_common(request.stage, request.tokens, request.coords)
        if self.kind == "tail":
            if request.grad_output is not None:
                raise ProtocolError("the tail computes its own loss; grad_output must be absent",
                                    ErrorCode.INVALID_REQUEST)
            if seq_len < 2:
                raise ProtocolError("the tail needs at least 2 tokens", ErrorCode.INVALID_TENSOR)
        else:
            self._check_coords(request.grad_output, seq_len, "grad_output")

    def check_evaluate(self, request: EvaluateRequest) -> None:
        seq_len = self._check_common(request.stage, request.tokens, request.coords)
        if self.kind == "tail" and seq_len < 2:
            raise ProtocolError("the tail needs at least 2 tokens", ErrorCode.INVALID_TENSOR)
        if request.grad_output is not None:
            if self.kind != "body":
                raise ProtocolError("grad_output is for a body stage (the tail takes input_grad, the head has no "
                                    "input gradient)", ErrorCode.INVALID_REQUEST)
            self._check_coords(request.grad_output, seq_len, "grad_output")
        if request.input_grad and self.kind != "tail":
            raise ProtocolError("input_grad is for the tail (a body stage takes grad_output)",
                                ErrorCode.INVALID_REQUEST)

    def _check_common(self, stage: int, tokens: torch.Tensor, coords: Optional[torch.Tensor]) -> int:
        if stage != self.stage:
            raise ProtocolError(f"this worker serves stage {self.stage}, not {stage}", ErrorCode.WRONG_STAGE)
        if tokens.dtype != torch.int64 or tokens.dim() != 1 or not 0 < tokens.numel() <= self.max_seq_len:
            raise ProtocolError(
                f"tokens must be int64 of shape [T] with 0 < T <= {self.max_seq_len}; "
                f"got {tokens.dtype} {list(tokens.shape)}", ErrorCode.INVALID_TENSOR)
        low, high = torch.aminmax(tokens)
        if int(low) < 0 or int(high) >= self.vocab_size:
            raise ProtocolError(f"token ids must lie in [0, {self.vocab_size})", ErrorCode.INVALID_TENSOR)
        seq_len = tokens.numel()
        if self.kind == "head":
            if coords is not None:
                raise ProtocolError("the head embeds tokens itself; coords must be absent", ErrorCode.INVALID_REQUEST)
        else:
            self._check_coords(coords, seq_len, "coords")
        return seq_len

    def _check_coords(self, tensor: Optional[torch.Tensor], seq_len: int, name: str) -> None:
        if tensor is None:
            raise ProtocolError(f"{name} is required at stage {self.stage}", ErrorCode.INVALID_REQUEST)
        if tensor.dtype not in _COORD_DTYPES or list(tensor.shape) != [seq_len, self.rank]:
            raise ProtocolError(
                f"{name} must be float of shape [{seq_len}, {self.rank}]; got {tensor.dtype} {list(tensor.shape)}",
                ErrorCode.INVALID_TENSOR)
        if not all_finite(tensor):
            raise ProtocolError(f"{name} contains non-finite values", ErrorCode.INVALID_TENSOR)


def all_finite(tensor: torch.Tensor) -> bool:
    """torch.isfinite(t).all() in a fifth of the time for the float32 and float16 tensors a
    request brings (numpy's reduction has no dispatcher in front of it)."""
    if tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float16) and not tensor.requires_grad:
        return bool(np.isfinite(tensor.numpy()).all())
    return bool(torch.isfinite(tensor).all())
