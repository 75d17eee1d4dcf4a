"""A worker may compute its blocks in bfloat16 (`--compute-dtype`) beside float32 replicas: the
same weights, answers that differ by what bfloat16 rounds, well inside the spot checks' tolerance,
and each answer the same when asked again (the checks' self-contradiction test needs that)."""

from __future__ import annotations

import pytest
import torch

from protocol.messages import ForwardRequest
from protocol.run_config import load_run_config
from roles.worker.config import WorkerConfig
from roles.worker.serving.runtime import autocast_dtype
from tests.unit.test_step_boundaries import make_runtime


def test_auto_follows_the_run_on_a_gpu_and_stays_float32_on_the_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert autocast_dtype("auto", "bfloat16", cuda) == torch.bfloat16
    assert autocast_dtype("auto", "float32", cuda) is None
    assert autocast_dtype("auto", "bfloat16", cpu) is None
    assert autocast_dtype("bfloat16", "float32", cpu) == torch.bfloat16
    assert autocast_dtype("float32", "bfloat16", cuda) is None
    with pytest.raises(ValueError):
        WorkerConfig(compute_dtype="float16")


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a.float() - b.float()) / torch.linalg.vector_norm(b.float()))


def test_a_bfloat16_replica_answers_within_the_tolerance_of_a_float32_one_and_the_same_twice():
    run = load_run_config("tiny")
    head = make_runtime(run, 0, start=False)
    tokens = torch.randint(0, run.model.vocab_size, (4, run.seq_len), generator=torch.Generator().manual_seed(0))
    requests = [ForwardRequest(stage=1, sample_id=f"s{i}", tokens=t,
                               coords=head._forward_batch([ForwardRequest(stage=0, sample_id=f"s{i}", tokens=t)])[0])
                for i, t in enumerate(tokens)]
    single = make_runtime(run, 1, start=False)
    mixed = make_runtime(run, 1, start=False, autocast_dtype=torch.bfloat16)
    full, half = single._forward_batch(requests), mixed._forward_batch(requests)
    again = mixed._forward_batch(requests)
    for f, h, a in zip(full, half, again):
        assert h.dtype == torch.float32  # the boundary stays float32: the wire is the run's
        assert 0 < _distance(h, f) < run.verification.tolerance / 4, _distance(h, f)
        assert torch.equal(h, a)
