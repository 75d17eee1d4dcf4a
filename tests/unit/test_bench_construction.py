"""scripts/bench_construction.py and its reference (roles/model/plain.py): transformers' Llama of
the run's very shape, every candidate keeps the boundary lossless, and a smoke run reports gaps
seed by seed."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_construction  # noqa: E402
from protocol.run_config import load_run_config  # noqa: E402
from roles.model.plain import PlainModel  # noqa: E402


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_the_reference_is_a_llama_of_the_runs_shape(size):
    run = load_run_config(size)
    reference = PlainModel(run)
    config = reference.llama.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, config.rms_norm_eps, config.tie_word_embeddings) == \
        (run.model.d_model, run.model.ffn_dim, run.model.n_layers, run.model.n_heads, run.model.n_heads,
         run.model.vocab_size, run.model.norm_eps, False)
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert rope["rope_theta"] == run.model.rope_theta
    groups = reference.stage_parameters(run)
    assert len(groups) == run.num_stages
    assert {id(p) for g in groups for p in g} == {id(p) for p in reference.parameters()}
    # the stage model at rank d with full-rank writes everywhere would hold the same weights
    full = load_run_config(size, {"model": {"subspace_rank": run.model.d_model, "construction": "fixed-embedding"}})
    assert sum(p.numel() for p in reference.parameters()) == \
        sum(p.numel() for stage in bench_construction.build_stages(full) for p in stage.parameters())


def test_the_reference_is_seeded_and_leaves_the_global_rng_alone():
    run = load_run_config("tiny")
    state = torch.random.get_rng_state()
    a, b = PlainModel(run), PlainModel(run)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    other = PlainModel(run.model_copy(update={"seed": 1}))
    assert not torch.equal(next(other.parameters()), next(a.parameters()))


@pytest.mark.parametrize("name", list(bench_construction.ABLATION))
def test_every_candidate_trains_and_keeps_its_boundaries_lossless(name):
    """A step's gradients reach every trainable group, and what crosses each boundary is the
    stream minus what the receiving stage regenerates (k coordinates and the token ids)."""
    run = load_run_config("tiny")
    model, groups = bench_construction.ABLATION[name][1](run)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens).sum().backward()
    assert all(any(p.grad is not None and p.grad.abs().sum() > 0 for p in g) for g in groups), name
    stages = list(model.stages)
    with torch.no_grad():
        hidden = stages[0].run_blocks(stages[0].enter(None, tokens))
        coords = stages[0].leave(hidden, tokens)
        passed = stages[1].enter(coords, tokens)
        own = lambda stage, h: h if stage.anchor is None else h - stage.anchor_rows(tokens)  # noqa: E731
        error = (own(stages[1], passed) - own(stages[0], hidden)).norm() / own(stages[0], hidden).norm()
    assert error < 1e-5, name


def test_a_quick_run_reports_every_model_against_the_reference(tmp_path, capsys):
    out = tmp_path / "construction.json"
    assert bench_construction.main(["--quick", "--models", "hf_llama,stage_anchors,fixed_embedding",
                                    "--out", str(out)]) == 0
    import json

    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["steps"] == 10 and result["seeds"] == [0]
    models = result["models"]
    assert models["hf_llama"]["gap_vs_hf_llama"] == 0.0
    for name in ("stage_anchors", "fixed_embedding"):
        assert models[name]["held_out_mean"] > 0 and "gap_vs_hf_llama" in models[name]
    assert models["stage_anchors"]["parameters"] > models["fixed_embedding"]["parameters"]
    # seed 0's own held-out set is the common one
    assert all(m["runs"][0]["held_out_common"] == m["runs"][0]["held_out_loss"] for m in models.values())
    assert all(m["common_spread"] == 0.0 for m in models.values())


def test_bad_arguments_are_one_line_errors(capsys):
    for argv in (["--models", "gpt5"], ["--budget", "forever"], ["--seeds", "a,b"]):
        with pytest.raises(SystemExit) as exit_info:
            bench_construction.parse_args(argv)
        assert exit_info.value.code == 2
    assert "unknown gpt5" in capsys.readouterr().err
