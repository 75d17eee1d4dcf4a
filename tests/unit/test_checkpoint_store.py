"""Run checkpoints in a store (roles/checkpoint_store.py, roles/worker/state/run_checkpoint_io.py): complete only
once every stage is there, verified before use, pruned to the newest K, and a resumed stage steps
exactly as the one that wrote it would have."""

from __future__ import annotations

import torch

from protocol.run_config import load_run_config
from roles.checkpoint_store import CheckpointStore, CheckpointStoreError
from roles.model.stage import build_stage_model
from roles.worker.layout import FlatLayout
from roles.worker.steps.optimizer import StageOptimizer
from roles.worker.state.run_checkpoint_io import RunCheckpointWriter, apply_state, load_latest

import pytest


def _stage(run, stage: int):
    model = build_stage_model(run, stage, device=torch.device("cpu"))
    optimizer = StageOptimizer.for_stage(run, stage, model.trainable_parameters(), torch.device("cpu"),
                                         payload=[t for _, t in model.averaged_payload()])
    return model, optimizer, FlatLayout.of_stage(model)


def _train(optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in optimizer.params:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-2
        optimizer.add_samples(optimizer.target_batch_size)
        optimizer.step()


def _writers(run, store, optimizers, layouts):
    return [RunCheckpointWriter(store, stage=s, writer=f"peer{s}", optimizer=optimizers[s], layout=layouts[s],
                                every_steps=2, keep=2, may_write=lambda: True) for s in range(run.num_stages)]


def test_a_checkpoint_is_complete_only_with_every_stage_and_resumes_exactly(tmp_path):
    run = load_run_config("tiny", {"run_id": "ckpt-unit"})
    store = CheckpointStore(f"file://{tmp_path}/store", run.run_id, run.num_stages)
    stages = [_stage(run, s) for s in range(run.num_stages)]
    optimizers, layouts = [s[1] for s in stages], [s[2] for s in stages]
    writers = _writers(run, store, optimizers, layouts)
    for s, optimizer in enumerate(optimizers):
        _train(optimizer, 2, seed=s)
    for s in range(run.num_stages - 1):  # the last stage has not uploaded yet: nothing is complete
        with optimizers[s].lock:
            writers[s].after_step(optimizers[s].local_step)
        writers[s].close(30)
    assert store.steps() == [2] and store.latest() is None
    with optimizers[-1].lock:
        writers[-1].after_step(optimizers[-1].local_step)
    writers[-1].close(30)
    latest = store.latest()
    assert latest is not None and latest.step == 2 and [e.writer for e in latest.stages] == [
        f"peer{s}" for s in range(run.num_stages)]

    # a fresh stage loads it: same weights, moments, step and schedule position; one more step agrees
    _, fresh, layout = _stage(run, 0)
    manifest, state = load_latest(store, 0, layout, tmp_path / "work")
    apply_state(state, fresh, layout, with_optimizer=True)
    assert (fresh.local_step, fresh.samples_consumed) == (optimizers[0].local_step, optimizers[0].samples_consumed)
    for a, b in zip(fresh.master_params, optimizers[0].master_params):
        assert torch.equal(a, b)
    _train(fresh, 1, seed=99)
    _train(optimizers[0], 1, seed=99)
    for a, b in zip(fresh.master_params, optimizers[0].master_params):
        assert torch.equal(a, b), "the resumed stage stepped differently: optimizer state not restored"

    # a damaged object is refused, never loaded
    path = tmp_path / "store" / run.run_id / "step-000000002" / latest.stages[1].file
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointStoreError, match="does not match its manifest"):
        store.fetch_stage(latest, 1, tmp_path / "work")
    assert load_latest(store, 1, layouts[1], tmp_path / "work") is None, "no intact checkpoint of stage 1 is left"


def test_retention_keeps_the_newest_complete_checkpoints_and_drops_older_partial_ones(tmp_path):
    run = load_run_config("tiny", {"run_id": "ckpt-prune"})
    store = CheckpointStore(str(tmp_path / "store"), run.run_id, run.num_stages)
    stages = [_stage(run, s) for s in range(run.num_stages)]
    optimizers, layouts = [s[1] for s in stages], [s[2] for s in stages]
    writers = _writers(run, store, optimizers, layouts)
    for round_ in range(4):  # steps 2, 4, 6, 8; step 4 stays partial (the tail's upload never came)
        for s, optimizer in enumerate(optimizers):
            _train(optimizer, 2, seed=round_)
            if not (round_ == 1 and s == run.num_stages - 1):
                with optimizer.lock:
                    writers[s].after_step(optimizer.local_step)
                writers[s].close(30)
                writers[s] = _writers(run, store, optimizers, layouts)[s]
    assert store.complete_steps() == [6, 8]
    assert store.steps() == [6, 8], "the partial step 4 and the complete step 2 are pruned"
    assert store.latest().step == 8
