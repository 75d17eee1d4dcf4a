"""Boundary coordinates and their gradients travel in the run's `boundary_dtype` (issue 23): a
bfloat16 run sends half the bytes, and the next stage computes on them as before."""

from __future__ import annotations

import pytest
import torch

from protocol.codec import decode_tensor, encode_tensor
from protocol.messages import BackwardRequest, ForwardRequest
from protocol.run_config import load_run_config
from tests.unit.test_step_boundaries import make_runtime


@pytest.mark.parametrize("dtype, wire, expected", [("float32", "auto", torch.float32),
                                                    ("bfloat16", "auto", torch.bfloat16),
                                                    ("bfloat16", "float32", torch.float32)])
def test_a_stage_sends_its_coordinates_and_gradients_in_the_runs_boundary_dtype(dtype, wire, expected):
    run = load_run_config("tiny", {"dtype": dtype, "wire_dtype": wire})
    assert getattr(torch, run.boundary_dtype) == expected
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    head = make_runtime(run, 0, start=False, autocast_dtype=autocast, wire_dtype=expected)
    body = make_runtime(run, 1, start=False, autocast_dtype=autocast, wire_dtype=expected)
    tokens = torch.randint(0, run.model.vocab_size, (run.seq_len,))
    (coords,) = head._forward_batch([ForwardRequest(stage=0, sample_id="s", tokens=tokens)])
    assert coords.dtype == expected and coords.shape == (run.seq_len, run.model.subspace_rank)
    on_wire = decode_tensor(encode_tensor(coords))
    body.check_forward(ForwardRequest(stage=1, sample_id="s", tokens=tokens, coords=on_wire))  # accepted as it is
    grad = torch.randn(run.seq_len, run.model.subspace_rank).to(expected)
    (result,) = body._backward_batch([BackwardRequest(stage=1, sample_id="s", tokens=tokens, coords=on_wire,
                                                      grad_output=grad, step=0)])
    assert result.grad_input.dtype == expected and torch.isfinite(result.grad_input.float()).all()
    assert len(encode_tensor(coords)["data"]) == coords.numel() * (2 if expected == torch.bfloat16 else 4)
