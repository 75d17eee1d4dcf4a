"""The bandwidth plan [report 3.5.2.1]: the report's 8B floor, a surrogate planning like the run it
mirrors, the wire bytes per sample, and `agora-node plan`'s output and exit codes."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from node.plan_cli import plan_main
from protocol.errors import ConfigError
from protocol.exit_codes import ExitCode
from protocol.run_config import load_run_config
from roles.model.traffic_plan import REPORT_BODY_MBPS, plan_traffic


def test_an_8b_four_block_body_stage_lands_on_the_reports_floor():
    run = load_run_config("8b")
    plan = plan_traffic(run, a_f=3, a_b=3, ar_time_s=10)
    for stage in plan.stages:
        if stage.kind == "body" and run.stages[stage.stage].num_layers == 4:
            assert stage.total_mbps_bf16 == pytest.approx(REPORT_BODY_MBPS["bf16"], rel=0.10)
            assert stage.total_mbps_fp32 == pytest.approx(REPORT_BODY_MBPS["fp32"], rel=0.10)
    body = plan.stage(1)
    # the boundary is k = 51 wide, not d_model: 32 bits x 6 samples/s x 4096 x 51
    assert body.activation_mbps == pytest.approx(32 * 6 * 4096 * 51 / 1e6)
    assert body.round_values == pytest.approx(885e6 / 20, rel=0.01)


def test_a_surrogate_plans_like_the_run_it_mirrors():
    for name, real in (("surrogate-8b", "8b"), ("surrogate-1b", "1b")):
        surrogate_plan = plan_traffic(load_run_config(name))
        real_plan = plan_traffic(load_run_config(real))
        assert surrogate_plan.mirrors == real and real_plan.mirrors is None
        assert [asdict(s) for s in surrogate_plan.stages] == [asdict(s) for s in real_plan.stages]


def test_wire_bytes_per_sample_and_round():
    run = load_run_config("8b")
    t, k = run.seq_len, run.model.subspace_rank
    plan = plan_traffic(run)
    head, body, tail = plan.stage(0), plan.stage(1), plan.stage(run.num_stages - 1)
    # a bfloat16 run's coordinates travel as bfloat16 (wire_dtype auto); int64 tokens travel beside
    # them, and a backward request carries the input again
    assert run.boundary_dtype == "bfloat16"
    c = 2
    assert body.forward_bytes_in == t * 8 + t * k * c and body.forward_bytes_out == t * k * c
    assert body.backward_bytes_in == t * 8 + 2 * t * k * c and body.backward_bytes_out == t * k * c
    assert body.sample_bytes == 5 * t * k * c + 2 * t * 8
    as_float32 = plan_traffic(load_run_config("8b", {"wire_dtype": "float32"})).stage(1)
    assert as_float32.sample_bytes == 5 * t * k * 4 + 2 * t * 8
    assert load_run_config("tiny").boundary_dtype == "float32"
    assert head.backward_bytes_out == 0 and head.forward_bytes_in == t * 8
    assert tail.forward_bytes_in == tail.forward_bytes_out == 0
    assert body.round_bytes(4) == 2 * body.round_bytes(2) == 4 * body.round_values
    assert body.allreduce_bytes_sent(1) == 0
    assert body.allreduce_bytes_sent(2) == body.round_bytes(4)
    fields = body.to_dict()
    assert {"sample_bytes", "round_values", "round_bytes_fp32", "total_mbps_bf16"} <= set(fields)


def test_rates_scale_and_bad_rates_are_refused():
    run = load_run_config("1b")
    slow, fast = plan_traffic(run, a_f=1, a_b=1, ar_time_s=20), plan_traffic(run, a_f=2, a_b=2, ar_time_s=10)
    assert fast.stage(1).activation_mbps == pytest.approx(2 * slow.stage(1).activation_mbps)
    assert fast.stage(1).averaging_mbps_fp32 == pytest.approx(2 * slow.stage(1).averaging_mbps_fp32)
    with pytest.raises(ValueError):
        plan_traffic(run, ar_time_s=0)
    with pytest.raises(ConfigError):
        plan_traffic(run, stages=[7])


def test_plan_cli_prints_a_table_and_the_comparison(capsys):
    assert plan_main(["--config", "8b"]) == ExitCode.OK
    out = capsys.readouterr().out
    assert "pluralis-8b" in out and "body" in out and "tail" in out
    assert "~113" in out and "~186" in out and "110.9 / 181.7" in out


def test_plan_cli_json_for_one_stage(capsys):
    assert plan_main(["--config", "surrogate-8b", "--stage", "1", "--json", "--a-f", "2"]) == ExitCode.OK
    plan = json.loads(capsys.readouterr().out)
    assert plan["mirrors"] == "8b" and plan["a_f"] == 2.0 and [s["stage"] for s in plan["stages"]] == [1]
    assert plan["stages"][0]["round_values"] == plan_traffic(load_run_config("8b")).stage(1).round_values


@pytest.mark.parametrize("argv, fragment", [
    (["--config", "no-such-preset"], "no such file"),
    (["--config", "8b", "--stage", "9"], "stage 9 does not exist"),
    (["--config", "8b", "--a-f", "-1"], "--a-f"),
    (["--config", "8b", "--ar-time-s", "0"], "--ar-time-s"),
    (["--stage", "1"], "--config"),
    (["--config", "8b", "--bogus"], "unrecognized"),
])
def test_plan_cli_bad_input_is_one_line_and_exit_2(capsys, argv, fragment):
    assert plan_main(argv) == ExitCode.USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], captured.err
