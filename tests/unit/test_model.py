"""The stage model: lossless boundaries, pipeline = unsplit model, determinism, learnability."""

from __future__ import annotations

import pytest
import torch

from protocol.run_config import RunConfig, load_run_config
from roles.model.layers import DenseLinear, SubspaceLinear
from roles.model.stage import FullModel, StageModel
from roles.model.subspace import (
    compress,
    fingerprint,
    fixed_token_embedding,
    reconstruct,
    subspace_basis,
)


@pytest.fixture(scope="module", params=["stage-anchors", "fixed-embedding"])
def tiny(request) -> RunConfig:
    """The tiny preset in each construction: the presets' stage anchors, and the fixed embedding
    that run configs written before issue 24 still name."""
    return load_run_config("tiny", {"model": {"construction": request.param}})


def own_part(stage: StageModel, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """What of a stage's stream the next stage must get back: all of it but this stage's anchor."""
    return hidden if stage.anchor is None else hidden - stage.anchor_rows(tokens)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Single-threaded torch: tiny matrices gain nothing from threads, and a shared CI box
    oversubscribed by several pytest processes makes multi-threaded kernels crawl."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def build(run: RunConfig, dtype: torch.dtype | None = None) -> list[StageModel]:
    """The run's stages; with `dtype`, cast and given a U_k orthonormal to that precision (the
    float32-rounded one is orthonormal only to ~1e-7, which a float64 check would measure)."""
    stages = [StageModel(run, index) for index in range(run.num_stages)]
    if dtype is not None:
        model = run.model
        basis = subspace_basis(model.d_model, model.subspace_rank, model.subspace_seed, dtype=dtype)
        for stage in stages:
            stage.to(dtype)
            for module in stage.modules():
                if "basis" in module._buffers:
                    module.basis = basis
    return stages


def sample_tokens(batch: int = 3, seq_len: int = 64, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, seq_len), generator=generator)


def grads(stages: list[StageModel]) -> dict[str, torch.Tensor]:
    return {
        f"{stage.stage_index}.{name}": param.grad.detach().clone()
        for stage in stages
        for name, param in stage.named_parameters()
    }


def zero_grads(stages: list[StageModel]) -> None:
    for stage in stages:
        stage.zero_grad(set_to_none=True)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.norm().clamp_min(1e-12)
    return ((actual - expected).norm() / scale).item()


def assert_grads_match(actual: dict, expected: dict, tolerance: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        error = relative_error(actual[name], expected[name])
        assert error <= tolerance, f"{name}: relative gradient error {error:.2e}"


def pipeline_step(stages: list[StageModel], tokens: torch.Tensor) -> torch.Tensor:
    """What the distributed pipeline does: a no-grad forward that keeps only each boundary's
    coordinates, then a backward that walks tail -> head, each stage recomputing its forward from
    its saved input and backpropagating the coordinate gradient its successor returned."""
    inputs: list[torch.Tensor | None] = [None]
    with torch.no_grad():
        for stage in stages[:-1]:
            inputs.append(stage(inputs[-1], tokens))
    boundary = inputs[-1].clone().requires_grad_(True)
    loss = stages[-1](boundary, tokens)
    loss.sum().backward()
    grad = boundary.grad
    for stage, saved in zip(reversed(stages[1:-1]), reversed(inputs[1:-1])):
        boundary = saved.clone().requires_grad_(True)
        stage(boundary, tokens).backward(grad)
        grad = boundary.grad
    stages[0](None, tokens).backward(grad)
    return loss.detach()


def test_basis_is_orthonormal_and_seeded():
    basis = subspace_basis(64, 16, seed=3)
    assert basis.shape == (64, 16) and basis.dtype == torch.float32
    assert torch.allclose(basis.T @ basis, torch.eye(16), atol=1e-6)
    assert torch.equal(basis, subspace_basis(64, 16, seed=3))
    assert not torch.equal(basis, subspace_basis(64, 16, seed=4))
    table = fixed_token_embedding(256, 64, seed=3)
    assert table.shape == (256, 64)
    assert 0.8 < table.norm(dim=1).mean().item() < 1.2
    assert fingerprint(table) == fingerprint(fixed_token_embedding(256, 64, seed=3))


def test_boundary_round_trip_is_lossless(tiny):
    head, body = StageModel(tiny, 0), StageModel(tiny, 1)
    tokens = sample_tokens()
    with torch.no_grad():
        hidden = head.run_blocks(head.enter(None, tokens))
        coords = head.leave(hidden, tokens)
        rebuilt = reconstruct(coords, tokens, body.fixed_embedding, body.basis)
        passed = body.enter(coords, tokens)
    assert coords.shape == (3, 64, tiny.model.subspace_rank)
    assert torch.equal(coords, head(None, tokens).detach())
    assert relative_error(rebuilt, own_part(head, hidden, tokens)) <= 1e-5
    assert relative_error(own_part(body, passed, tokens), own_part(head, hidden, tokens)) <= 1e-5


def test_stage_anchors_stay_off_the_boundary():
    """Each stage's anchor lies outside span(U_k): its rows vanish in the projection, so a stage
    may learn its own anchor without the boundary carrying anything but the k coordinates."""
    run = load_run_config("tiny")
    assert run.model.construction == "stage-anchors"
    stages = build(run)
    tokens = sample_tokens()
    with torch.no_grad():
        for stage in stages:
            stage.anchor.normal_()  # far from init, as after training
            rows = stage.anchor_rows(tokens)
            assert stage.fixed_embedding is None
            assert (rows @ stage.basis).norm() <= 1e-5 * rows.norm()
        assert not torch.equal(stages[0].anchor_rows(tokens), stages[1].anchor_rows(tokens))


def test_factored_anchors_count_and_train():
    run = load_run_config("tiny", {"model": {"anchor_rank": 8}})
    stages = build(run)
    assert stages[1].anchor.shape == (256, 8) and stages[1].anchor_basis.shape == (8, 64)
    loss = FullModel.from_stages(stages)(sample_tokens(batch=2, seq_len=16)).sum()
    loss.backward()
    assert stages[1].anchor.grad.abs().sum() > 0 and stages[1].anchor_basis.grad.abs().sum() > 0


def test_boundaries_stay_exact_under_autocast(tiny):
    """Workers may run blocks under bfloat16 autocast; the boundary must still be lossless."""
    head = StageModel(tiny, 0)
    tokens = sample_tokens()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = head.run_blocks(head.enter(None, tokens))
        coords = head(None, tokens)
        rebuilt = reconstruct(coords, tokens, head.fixed_embedding, head.basis)
    assert hidden.dtype == coords.dtype == torch.float32
    assert relative_error(rebuilt, own_part(head, hidden, tokens)) <= 1e-5


def test_block_writes_only_inside_the_subspace(tiny):
    body = StageModel(tiny, 1)
    tokens = sample_tokens()
    with torch.no_grad():
        hidden = body.enter(torch.randn(3, 64, 16), tokens)
        block = body.blocks[0]
        for update in (block.attn(block.attn_norm(hidden)), block.mlp(block.mlp_norm(hidden))):
            outside = update - update @ body.basis @ body.basis.T
            assert outside.norm() <= 1e-5 * update.norm()


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(None, 1e-5), (torch.float64, 1e-10)], ids=["float32", "float64"]
)
def test_chained_stages_match_full_model(tiny, dtype, tolerance):
    stages = build(tiny, dtype)
    tokens = sample_tokens()
    coords = None
    for stage in stages[:-1]:
        coords = stage(coords, tokens)
    chained_loss = stages[-1](coords, tokens)
    chained_loss.sum().backward()
    chained = grads(stages)
    zero_grads(stages)

    full_loss = FullModel.from_stages(stages)(tokens)
    full_loss.sum().backward()
    assert chained_loss.shape == (3,)
    assert relative_error(chained_loss.detach(), full_loss.detach()) <= tolerance
    assert_grads_match(chained, grads(stages), tolerance)


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(None, 1e-5), (torch.float64, 1e-10)], ids=["float32", "float64"]
)
def test_stage_by_stage_backward_matches_full_model(tiny, dtype, tolerance):
    stages = build(tiny, dtype)
    tokens = sample_tokens(seed=11)
    loss = pipeline_step(stages, tokens)
    pipelined = grads(stages)
    zero_grads(stages)

    full_loss = FullModel.from_stages(stages)(tokens)
    full_loss.sum().backward()
    assert relative_error(loss, full_loss.detach()) <= tolerance
    assert_grads_match(pipelined, grads(stages), tolerance)


def test_replicas_start_identical_and_stages_differ(tiny):
    first, second = build(tiny), build(tiny)
    for a, b in zip(first, second):
        assert torch.equal(a.basis, b.basis)
        assert (a.fixed_embedding is None and b.fixed_embedding is None) or torch.equal(a.fixed_embedding, b.fixed_embedding)
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(pa, pb), name
    qkv = [stage.blocks[0].attn.qkv_proj.weight for stage in first]
    assert not torch.equal(qkv[0], qkv[1]) and not torch.equal(qkv[1], qkv[2])
    reseeded = StageModel(tiny.model_copy(update={"seed": 1}), 1)
    assert torch.equal(reseeded.basis, first[1].basis)
    assert not torch.equal(reseeded.blocks[0].attn.qkv_proj.weight, qkv[1])


def test_basis_is_a_buffer_not_a_parameter(tiny):
    stage = StageModel(tiny, 1)
    trainable = {id(param) for param in stage.trainable_parameters()}
    assert trainable == {id(param) for param in stage.parameters()}
    assert all(id(buffer) not in trainable for buffer in stage.buffers())
    assert not any("basis" in key or "fixed" in key for key in stage.state_dict())
    out_proj = stage.blocks[0].attn.out_proj
    assert isinstance(out_proj, SubspaceLinear) and out_proj.z.shape == (64, 16)


def test_tail_output_projections_follow_tail_full_rank():
    full = StageModel(load_run_config("tiny"), 2)
    assert isinstance(full.blocks[0].mlp.down_proj, DenseLinear)
    low = StageModel(load_run_config("tiny", {"model": {"tail_full_rank": False}}), 2)
    assert isinstance(low.blocks[0].mlp.down_proj, SubspaceLinear)


def test_bfloat16_stages_keep_float32_boundaries():
    run = load_run_config("tiny", {"dtype": "bfloat16"})
    stages = build(run)
    assert stages[1].blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
    tokens = sample_tokens(batch=2, seq_len=16)
    coords = stages[0](None, tokens)
    assert coords.dtype == torch.float32
    loss = stages[2](stages[1](coords, tokens), tokens)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()


def test_forward_rejects_malformed_inputs(tiny):
    head, body = StageModel(tiny, 0), StageModel(tiny, 1)
    tokens = sample_tokens(batch=2, seq_len=8)
    with pytest.raises(ValueError, match="coords=None"):
        head(torch.zeros(2, 8, 16), tokens)
    with pytest.raises(ValueError, match="expects coords"):
        body(torch.zeros(2, 8, 15), tokens)
    with pytest.raises(ValueError, match="sequence length"):
        body(torch.zeros(2, 200, 16), sample_tokens(batch=2, seq_len=200))
    with pytest.raises(ValueError, match="head, bodies"):
        FullModel.from_stages([body, head])


def test_tiny_learns_a_repetitive_byte_sequence(tiny):
    stages = build(tiny)
    params = [param for stage in stages for param in stage.trainable_parameters()]
    optimizer = torch.optim.AdamW(params, lr=tiny.optimizer.lr, weight_decay=0.0)
    text = b"the quick brown fox jumps over the lazy dog. " * 8
    data = torch.tensor(list(text), dtype=torch.int64)
    starts = torch.arange(0, 8) * 13
    batch = torch.stack([data[s : s + tiny.seq_len] for s in starts.tolist()])
    losses = []
    for _ in range(25):
        optimizer.zero_grad(set_to_none=True)
        losses.append(pipeline_step(stages, batch).mean().item())
        optimizer.step()
    assert losses[0] > 5.0
    assert losses[-1] < 0.5 * losses[0], losses
