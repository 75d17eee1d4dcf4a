"""StageOptimizer against torch's own clip + AdamW, and the learning-rate schedule [report 3.3.1, 4.3]."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from torch import nn

from protocol.errors import AgoraError
from protocol.run_config import OptimizerConfig
from roles.worker.steps.optimizer import NonFiniteGradients, StageOptimizer, stage_clip_threshold

# eps is large on purpose: with a tiny eps AdamW is almost blind to the gradient's scale, and these
# tests must see whether the gradients were averaged and clipped correctly.
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-2, weight_decay=0.1, warmup_steps=2, total_steps=20, min_lr_ratio=0.1)
SCHEDULE = {k: HP[k] for k in ("lr", "warmup_steps", "total_steps", "min_lr_ratio")}


def lr_at(position, *, lr, warmup_steps, total_steps, min_lr_ratio):
    return OptimizerConfig(lr=lr, warmup_steps=warmup_steps, total_steps=total_steps,
                           min_lr_ratio=min_lr_ratio).lr_at(position)


def make_model(seed: int = 0, dtype=torch.float32, device="cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(device=device, dtype=dtype)


def make_data(seed: int, n: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def per_sample_loss(model, x, y):
    p = next(model.parameters())
    out = model(x.to(p.device, p.dtype)).float()
    return ((out - y.to(out.device)) ** 2).sum(dim=1)


def make_opt(model, *, clip=1e6, device="cpu", target_batch_size=8, **kw) -> StageOptimizer:
    return StageOptimizer(list(model.parameters()), **HP, clip_threshold=clip, device=torch.device(device),
                          target_batch_size=target_batch_size, **kw)


def accumulate(opt, model, x, y, splits):
    """Backward a SUM loss per chunk, as the runtime does for each coalesced batch."""
    start = 0
    for n in splits:
        with opt.lock:
            per_sample_loss(model, x[start : start + n], y[start : start + n]).sum().backward()
            opt.add_samples(n)
        start += n


def reference_step(ref, ref_opt, x, y, step, clip=None) -> float:
    per_sample_loss(ref, x, y).mean().backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else math.inf))
    for group in ref_opt.param_groups:
        group["lr"] = lr_at(step, **SCHEDULE)
    ref_opt.step()
    ref_opt.zero_grad()
    return norm


def make_reference(model):
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"])
    return ref, ref_opt


def assert_params_close(a, b, atol=1e-6):
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.detach().cpu().float(), pb.detach().cpu().float(), atol=atol, rtol=1e-5)


def test_schedule_points():
    s = dict(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, **s) == pytest.approx(0.1)
    assert lr_at(9, **s) == pytest.approx(1.0)
    assert lr_at(10, **s) == pytest.approx(1.0)
    assert lr_at(60, **s) == pytest.approx(0.55)
    assert lr_at(110, **s) == pytest.approx(0.1)
    assert lr_at(10_000, **s) == pytest.approx(0.1)
    rates = [lr_at(i, **s) for i in range(10, 120)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    assert lr_at(0, lr=3e-4, warmup_steps=0, total_steps=100, min_lr_ratio=0.0) == pytest.approx(3e-4)
    with pytest.raises(ValueError):
        lr_at(-1, **s)


def test_stage_clip_threshold():
    assert stage_clip_threshold(4, is_tail=False) == pytest.approx(0.5)
    assert stage_clip_threshold(4, is_tail=True) == pytest.approx(1.0)
    assert stage_clip_threshold(1, is_tail=False) == pytest.approx(1.0)


def test_mean_over_samples_matches_adamw_over_several_steps():
    model = make_model()
    ref, ref_opt = make_reference(model)
    opt = make_opt(model)
    for step, splits in enumerate([(3, 5), (8,), (1, 1, 6)]):
        x, y = make_data(step)
        accumulate(opt, model, x, y, splits)
        assert opt.samples_accumulated == 8
        report = opt.step()
        ref_norm = reference_step(ref, ref_opt, x, y, step)
        assert report.step == step and report.samples == 8 and not report.clipped
        assert report.lr == pytest.approx(lr_at(step, **SCHEDULE))
        assert report.grad_norm == pytest.approx(ref_norm, rel=1e-5)
        assert_params_close(model, ref)
        assert opt.local_step == step + 1 and opt.samples_accumulated == 0
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("force_master_copy", [False, True])
def test_clipping_matches_torch_clip_then_adamw(force_master_copy):
    model = make_model()
    ref, ref_opt = make_reference(model)
    opt = make_opt(model, clip=0.05, force_master_copy=force_master_copy)
    x, y = make_data(1)
    accumulate(opt, model, x, y, (3, 5))
    report = opt.step()
    ref_norm = reference_step(ref, ref_opt, x, y, 0, clip=0.05)
    assert ref_norm > 0.05
    assert report.clipped and report.grad_norm == pytest.approx(ref_norm, rel=1e-5)
    assert_params_close(model, ref)

    unclipped = make_model()
    ref_u, _ = make_reference(unclipped)
    opt_u = make_opt(ref_u, clip=1e6)
    accumulate(opt_u, ref_u, x, y, (8,))
    opt_u.step()
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), ref_u.parameters()))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_gradients_raise_and_leave_params_unchanged(bad):
    model = make_model()
    before = copy.deepcopy(model)
    opt = make_opt(model)
    x, y = make_data(2)
    accumulate(opt, model, x, y, (8,))
    next(model.parameters()).grad[0, 0] = bad
    with pytest.raises(NonFiniteGradients) as info:
        opt.step()
    assert isinstance(info.value, AgoraError)
    assert_params_close(model, before, atol=0)
    assert all(p.grad is None for p in model.parameters())
    # The step counts as taken (its samples are lost), so this replica stays at its stage's step.
    assert opt.samples_accumulated == 0 and opt.local_step == 1
    assert opt.state_dict()["optimizer"]["state"] == {}


def test_zero_sample_step_only_advances_the_schedule():
    model = make_model()
    before = copy.deepcopy(model)
    opt = make_opt(model)
    report = opt.step()
    assert report.samples == 0 and report.step == 0 and report.grad_norm == 0.0 and not report.clipped
    assert report.lr == pytest.approx(lr_at(0, **SCHEDULE))
    assert opt.local_step == 1
    assert_params_close(model, before, atol=0)
    assert opt.state_dict()["optimizer"]["state"] == {}


def test_set_step_moves_the_schedule():
    model = make_model()
    opt = make_opt(model)
    opt.set_step(11)
    accumulate(opt, model, *make_data(3), (8,))
    report = opt.step()
    assert report.step == 11 and report.lr == pytest.approx(lr_at(11, **SCHEDULE))
    assert opt.local_step == 12


def test_cpu_float32_master_is_the_parameter_itself():
    model = make_model()
    opt = make_opt(model)
    assert opt.shares_master
    assert all(m is p for m, p in zip(opt.master_params, model.parameters()))


def test_forced_master_copy_matches_shared_path():
    shared_model, copied_model = make_model(), make_model()
    shared = make_opt(shared_model, clip=0.5)
    copied = make_opt(copied_model, clip=0.5, force_master_copy=True)
    assert not copied.shares_master
    for m, p in zip(copied.master_params, copied_model.parameters()):
        assert m.dtype == torch.float32 and m.device.type == "cpu" and m.data_ptr() != p.data_ptr()
    for step in range(4):
        x, y = make_data(10 + step)
        for opt, model in ((shared, shared_model), (copied, copied_model)):
            accumulate(opt, model, x, y, (2, 6))
        a, b = shared.step(), copied.step()
        assert a == b
    for pa, pb in zip(shared_model.parameters(), copied_model.parameters()):
        assert torch.equal(pa, pb)


def test_low_precision_cpu_params_get_a_float32_master():
    model = make_model(dtype=torch.bfloat16)
    opt = make_opt(model)
    assert not opt.shares_master and all(m.dtype == torch.float32 for m in opt.master_params)
    accumulate(opt, model, *make_data(4), (8,))
    opt.step()
    for m, p in zip(opt.master_params, model.parameters()):
        assert torch.equal(m.to(torch.bfloat16), p.detach())


def test_push_master_to_device_after_an_averager_edit():
    model = make_model()
    opt = make_opt(model, force_master_copy=True)
    with opt.lock, torch.no_grad():
        for m in opt.master_params:
            m.fill_(0.25)
        opt.push_master_to_device()
    assert all(torch.all(p == 0.25) for p in model.parameters())


def test_state_dict_round_trip():
    model = make_model()
    opt = make_opt(model)
    for step in range(2):
        accumulate(opt, model, *make_data(20 + step), (8,))
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    twin_opt = make_opt(twin)
    twin_opt.load_state_dict(state)
    assert twin_opt.local_step == 2
    for opt_, model_ in ((opt, model), (twin_opt, twin)):
        accumulate(opt_, model_, *make_data(30), (8,))
        opt_.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        twin_opt.load_state_dict({**state, "version": 999})


def test_step_waits_for_a_holder_of_the_lock():
    model = make_model()
    opt = make_opt(model)
    stepped = threading.Event()
    with opt.lock:
        worker = threading.Thread(target=lambda: (opt.step(), stepped.set()))
        worker.start()
        assert not stepped.wait(0.05)  # a window in which the step must not run: the assertion itself
    assert stepped.wait(5)
    worker.join(timeout=5)


def test_rejects_bad_arguments():
    model = make_model()
    with pytest.raises(ValueError):
        make_opt(model, clip=0.0)
    with pytest.raises(ValueError):
        StageOptimizer([], **HP, clip_threshold=1.0, device=torch.device("cpu"))
    with pytest.raises(ValueError):
        make_opt(model, device="cuda")
    with pytest.raises(ValueError):
        make_opt(model).add_samples(-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_path_keeps_master_on_pinned_cpu_and_matches_cpu(dtype):
    cpu_model, gpu_model = make_model(dtype=dtype), make_model(dtype=dtype, device="cuda")
    cpu_opt = make_opt(cpu_model, clip=0.5, force_master_copy=True)
    gpu_opt = make_opt(gpu_model, clip=0.5, device="cuda")
    assert not gpu_opt.shares_master
    assert all(m.device.type == "cpu" and m.is_pinned() for m in gpu_opt.master_params)
    for step in range(3):
        x, y = make_data(40 + step)
        accumulate(cpu_opt, cpu_model, x, y, (3, 5))
        accumulate(gpu_opt, gpu_model, x, y, (3, 5))
        a, b = cpu_opt.step(), gpu_opt.step()
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-2 if dtype == torch.bfloat16 else 1e-4)
    assert all(p.device.type == "cuda" for p in gpu_model.parameters())
    for m_cpu, m_gpu in zip(cpu_opt.master_params, gpu_opt.master_params):
        torch.testing.assert_close(m_cpu, m_gpu, atol=5e-3 if dtype == torch.bfloat16 else 1e-5, rtol=1e-3)
    for m, p in zip(gpu_opt.master_params, gpu_model.parameters()):
        assert torch.equal(m.to(dtype), p.detach().cpu())
