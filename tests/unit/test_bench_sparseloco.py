"""scripts/bench_sparseloco.py: the one-process SparseLoCo it measures is the workers' (replicas
equal after a round that closes the run), dense and exact exchange every step is the one-process
model, and AsyncSPARTA's rounds use the workers' index sets."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_sparseloco  # noqa: E402
from _fidelity_reference import held_out_tokens  # noqa: E402
from protocol.run_config import load_run_config  # noqa: E402


def _run(cand, steps=4, replicas=2):
    run = load_run_config("tiny", {"target_batch_size": 8, "optimizer": {"total_steps": steps, "warmup_steps": 1}})
    return bench_sparseloco._run(run, steps, replicas, cand, held_out_tokens(run, 16))


def test_dense_exact_exchange_every_step_keeps_close_to_one_process_and_sparse_does_not():
    one = _run(None)["held_out_loss"]
    dense = _run(bench_sparseloco.Candidate("dense", 1, topk=4096, bits=8, beta=0.0))["held_out_loss"]
    sparse = _run(bench_sparseloco.Candidate("sparse", 1, topk=16))["held_out_loss"]
    # Each replica's step on half the batch, averaged every step, is nearly the step on the whole
    # batch (AdamW is not linear, so not exactly); 16 of 4,096 coordinates a round is far from it.
    assert abs(dense / one - 1) < 0.01, (dense, one)
    assert sparse > one * 1.02, (sparse, one)


def test_asyncsparta_rounds_run_and_report():
    found = _run(bench_sparseloco.Candidate("asyncsparta N2", 2, method="asyncsparta"))
    assert found["held_out_loss"] > 0 and found["final_train_loss"] > 0
