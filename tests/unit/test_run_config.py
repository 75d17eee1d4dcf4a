"""Run configuration: presets, YAML, overrides, and one-line errors that name the fix."""

from __future__ import annotations

import math

import pytest

from protocol.errors import ConfigError
from protocol.run_config import RunConfig, dump_run_config, load_run_config
from protocol.run_presets import PRESETS


def assert_one_line(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message, message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate(name):
    run = load_run_config(name)
    assert isinstance(run, RunConfig)
    assert run.stage_kind(0) == "head" and run.stage_kind(run.num_stages - 1) == "tail"
    assert run.stages[-1].last_layer == run.model.n_layers


def test_preset_shapes_follow_the_report():
    tiny, one_b, eight_b = (load_run_config(name) for name in ("tiny", "1b", "8b"))
    assert (tiny.num_stages, tiny.model.vocab_size, tiny.seq_len) == (3, 256, 64)
    assert (one_b.num_stages, one_b.model.subspace_rank, one_b.model.d_model) == (4, 40, 2048)
    assert [s.num_layers for s in eight_b.stages][-1] == 6
    assert (eight_b.num_stages, eight_b.model.n_layers, eight_b.dtype) == (7, 32, "bfloat16")


def test_stage_kinds_and_clip_thresholds():
    run = load_run_config("8b")
    assert [run.stage_kind(i) for i in range(7)] == ["head"] + ["body"] * 5 + ["tail"]
    assert run.clip_threshold(0) == pytest.approx(1 / math.sqrt(7))
    assert run.clip_threshold(3) == pytest.approx(1 / math.sqrt(7))
    assert run.clip_threshold(6) == pytest.approx(2 / math.sqrt(7))
    with pytest.raises(ConfigError, match="stage 7 does not exist"):
        run.stage_kind(7)


def test_overrides_deep_merge():
    two = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]
    run = load_run_config("tiny", {"stages": two, "model": {"d_model": 128}, "optimizer.lr": 1e-3})
    assert run.num_stages == 2 and run.stage_kind(1) == "tail"
    assert run.model.d_model == 128 and run.model.vocab_size == 256
    assert run.optimizer.lr == 1e-3 and run.optimizer.warmup_steps == 10
    assert load_run_config("tiny").model.d_model == 64


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (
            {"stages": [{"first_layer": 0, "last_layer": 1}, {"first_layer": 2, "last_layer": 3}]},
            ("config tiny:", "stage 1 starts at layer 2", "gap"),
        ),
        (
            {"stages": [{"first_layer": 0, "last_layer": 2}, {"first_layer": 1, "last_layer": 3}]},
            ("overlap",),
        ),
        (
            {"stages": [{"first_layer": 0, "last_layer": 1}, {"first_layer": 1, "last_layer": 2}]},
            ("stages must cover layers 0..3 exactly; got 0..2",),
        ),
        ({"stages": [{"first_layer": 0, "last_layer": 3}]}, ("at least a head and a tail",)),
        (
            {"stages": [{"first_layer": 0, "last_layer": 0}, {"first_layer": 0, "last_layer": 3}]},
            ("holds no blocks",),
        ),
        ({"model": {"subspace_rank": 65}}, ("model:", "subspace_rank 65 exceeds d_model 64")),
        ({"model": {"n_heads": 5}}, ("not divisible by n_heads 5",)),
        ({"seq_len": 256}, ("seq_len 256 exceeds model.max_seq_len 128",)),
        ({"model": {"d_model": 0}}, ("model.d_model:", "greater than 0")),
        ({"target_batch_size": -1}, ("target_batch_size:",)),
        ({"dtype": "float64"}, ("dtype:",)),
        ({"run_id": "a/b"}, ("run_id:",)),
        ({"model": {"colour": "blue"}}, ("model.colour:", "not a known field")),
        ({"optimizer": {"warmup_steps": 5000}}, ("warmup_steps 5000 exceeds total_steps 2000",)),
        ({"model": {"construction": "learned-subspace"}},
         ("model.construction:", "'learned-subspace', which this agora-node does not build", "upgrade agora-node")),
        ({"model": {"construction": "fixed-embedding", "anchor_rank": 8}},
         ("anchor_rank is set but construction is 'fixed-embedding'",)),
    ],
)
def test_validation_errors_are_one_line(overrides, fragments):
    with pytest.raises(ConfigError) as error:
        load_run_config("tiny", overrides)
    assert_one_line(error, *fragments)


def test_missing_field_in_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run_id: x\nseq_len: 8\n")
    with pytest.raises(ConfigError) as error:
        load_run_config(str(path))
    assert_one_line(error, str(path), "is required; add it", "more problem")


def test_bad_yaml_and_missing_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("run_id: x\nmodel: {d_model: 64\n")
    with pytest.raises(ConfigError) as error:
        load_run_config(str(path))
    assert_one_line(error, "broken.yaml", "invalid YAML at line")
    with pytest.raises(ConfigError) as error:
        load_run_config(str(tmp_path / "absent.yaml"))
    assert_one_line(error, "absent.yaml", "no such file", "tiny")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError) as error:
        load_run_config(str(listing))
    assert_one_line(error, "top level must be a mapping")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dump_then_load_round_trips(tmp_path, name):
    run = load_run_config(name, {"seed": 5})
    path = tmp_path / f"{name}.yaml"
    dump_run_config(run, path)
    assert load_run_config(str(path)) == run
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    dump_run_config(run.model_copy(update={"seed": 6}), path)
    assert load_run_config(str(path)).seed == 6


def test_config_is_frozen_and_keyword_only():
    run = load_run_config("tiny")
    with pytest.raises(Exception):
        run.seed = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        RunConfig("tiny")  # type: ignore[misc]


def test_learning_rate_schedule():
    opt = load_run_config("tiny").optimizer
    assert opt.lr_at(0) == pytest.approx(opt.lr / opt.warmup_steps)
    assert opt.lr_at(opt.warmup_steps - 1) == pytest.approx(opt.lr)
    assert opt.lr_at(opt.warmup_steps) == pytest.approx(opt.lr)
    assert opt.lr_at(opt.total_steps) == pytest.approx(opt.min_lr_ratio * opt.lr)
    assert opt.lr_at(10 * opt.total_steps) == pytest.approx(opt.min_lr_ratio * opt.lr)


def test_a_yaml_config_may_start_from_a_preset(tmp_path):
    from protocol.run_config import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny\nrun_id: my-run\ntarget_batch_size: 32\ndata:\n  location: s3://bucket/corpus\n"
                    "  manifest_sha256: " + "a" * 64 + "\n")
    run = load_run_config(str(path))
    tiny = load_run_config("tiny")
    assert run.run_id == "my-run" and run.target_batch_size == 32 and run.data.location == "s3://bucket/corpus"
    assert run.model == tiny.model and run.stages == tiny.stages and run.optimizer == tiny.optimizer
    path.write_text("preset: huge\n")
    with pytest.raises(ConfigError, match="preset 'huge' does not exist"):
        load_run_config(str(path))


def test_a_run_config_names_its_construction_and_old_ones_keep_theirs(tmp_path):
    """The presets train the stage-anchors construction; a config written before the field existed
    means the report's fixed embedding, so an old run's checkpoints still load as what they were."""
    from protocol.run_config import parse_run_config

    assert load_run_config("tiny").model.construction == "stage-anchors"
    assert load_run_config("8b").model.construction == "fixed-embedding"
    old = load_run_config("tiny").model_dump(mode="json")
    del old["model"]["construction"]
    assert parse_run_config(old, "an old file").model.construction == "fixed-embedding"
    with pytest.raises(ConfigError) as error:
        parse_run_config({**old, "model": {**old["model"], "construction": "v9"}}, "the authorizer's run config")
    assert_one_line(error, "the authorizer's run config: model.construction:", "upgrade agora-node")
