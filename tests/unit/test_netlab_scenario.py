"""Scenario files and the arithmetic of a scenario's result: what a bad file says, how links and
overrides resolve, how samples and averaging rounds are tallied, and what the plan predicts."""

from __future__ import annotations

import os

import pytest

from node.netlab.scenario import LinkModel, _accounting, _averaging, load_scenario, merged
from node.netlab.traffic_check import predicted_bytes, rounds_cut_by_stop
from protocol.errors import ConfigError
from protocol.run_config import load_run_config
from roles.model.traffic_plan import plan_traffic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCENARIOS = os.path.join(ROOT, "scenarios")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(SCENARIOS) if f.endswith(".yaml")))
def test_every_shipped_scenario_loads_and_its_run_config_validates(name):
    scenario, base = load_scenario(os.path.join(SCENARIOS, name))
    run = load_run_config(scenario.run.config, scenario.run.overrides)
    for node in scenario.nodes:
        if node.role == "worker":
            assert node.stage < run.num_stages, f"{name}: {node.name} on stage {node.stage} of {run.num_stages}"
    for stage in range(run.num_stages):
        assert any(n.role == "worker" and n.stage == stage for n in scenario.nodes), f"{name}: stage {stage} empty"


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return str(path)


BASE = """
name: t
run: {config: tiny}
duration_s: 10
nodes:
  - {name: auth, role: authorizer}
  - {name: w0, role: worker, stage: 0}
"""


@pytest.mark.parametrize("extra, phrase", [
    ("  - {name: w0, role: worker, stage: 1}\n", "unique"),
    ("  - {name: w1, role: worker}\n", "needs a stage"),
    ("  - {name: a2, role: authorizer}\n", "exactly one authorizer"),
    ("  - {name: w1, role: worker, stage: 0, link: nowhere}\n", "links does not define"),
    ("  - {name: W_1, role: worker, stage: 0}\n", "name"),
    ("  - {name: w1, role: worker, stage: 0, behind: nowhere}\n", "routers does not define"),
    ("  - {name: w1, role: worker, stage: 0, behind: home, link: {rtt_ms: 5}}\nrouters: [{name: home}]\n",
     "give the router the link"),
    ("  - {name: home, role: worker, stage: 0}\nrouters: [{name: home}]\n", "different names"),
])
def test_bad_scenarios_are_one_line_errors(tmp_path, extra, phrase):
    with pytest.raises(ConfigError) as raised:
        load_scenario(_write(tmp_path, BASE + extra))
    assert phrase in str(raised.value) and "\n" not in str(raised.value)


def test_an_event_naming_an_unknown_node_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="unknown node ghost"):
        load_scenario(_write(tmp_path, BASE + "events:\n  - {at_s: 1, kill: [ghost]}\n"))


def test_links_resolve_by_name_then_role_then_unshaped(tmp_path):
    text = BASE + "  - {name: w1, role: worker, stage: 0, link: slow}\n  - {name: t0, role: trainer}\n" + \
        "links:\n  slow: {up_mbit: 50, rtt_ms: 100}\n  worker: {rtt_ms: 20}\n"
    scenario, _ = load_scenario(_write(tmp_path, text))
    by_name = {n.name: scenario.link_of(n) for n in scenario.nodes}
    assert by_name["w1"] == LinkModel(up_mbit=50, rtt_ms=100)
    assert by_name["w0"] == LinkModel(rtt_ms=20)
    assert by_name["t0"] == LinkModel()


def test_nodes_behind_routers_take_the_routers_link_two_levels_deep(tmp_path):
    text = BASE + ("  - {name: w1, role: worker, stage: 0, behind: home}\n  - {name: w2, role: worker, stage: 0, "
                   "behind: isp}\n  - {name: r, role: relay}\nrouters:\n  - {name: home, link: {up_mbit: 20}}\n"
                   "  - {name: cgn, link: {up_mbit: 30}}\n  - {name: isp, behind: cgn}\n")
    scenario, _ = load_scenario(_write(tmp_path, text))
    hosts = {h.name: h for h in scenario.hosts()}
    assert hosts["home"].up_mbit == 20 and hosts["home"].behind is None
    assert hosts["w1"].behind == "home" and hosts["w1"].up_mbit is None
    assert hosts["w2"].behind == "isp" and hosts["isp"].behind == "cgn" and hosts["cgn"].up_mbit == 30
    assert hosts["r"].behind is None


def test_overrides_merge_nested_and_dotted_keys():
    base = {"links": {"c": {"rtt_ms": 1, "up_mbit": 5}}, "duration_s": 10}
    out = merged(base, {"links.c.rtt_ms": 80, "duration_s": 20})
    assert out == {"links": {"c": {"rtt_ms": 80, "up_mbit": 5}}, "duration_s": 20}
    assert base["links"]["c"]["rtt_ms"] == 1  # the base is not changed


def test_accounting_sums_every_trainer_incarnation_and_finds_the_unaccounted():
    summaries = [
        {"name": "t0", "role": "trainer", "summary": {"samples_started": 10, "samples_completed": 7,
                                                     "samples_dropped": 2, "samples_in_flight": 0,
                                                     "dropped_by_reason": {"no_workers": 2}}},
        {"name": "t0.1", "role": "trainer", "summary": {"samples_started": 5, "samples_completed": 5,
                                                       "samples_dropped": 0, "samples_in_flight": 0}},
        {"name": "t1", "role": "trainer", "summary": None},
        {"name": "w0", "role": "worker", "summary": {"samples_started": 99}},
    ]
    totals = _accounting(summaries)
    assert totals["samples_started"] == 15 and totals["samples_completed"] == 12
    assert totals["unaccounted"] == 1 and totals["trainers_without_summary"] == 1
    assert totals["dropped_by_reason"] == {"no_workers": 2}


def test_averaging_counts_a_round_below_full_completeness_as_failed():
    def rounds(*values):
        return [{"status": s, "averaging_success": a, "duration_s": d} for s, a, d in values]

    summaries = [{"name": "w0", "stage": 1, "summary": {"averaging": {"rounds": rounds(
        ("complete", 1.0, 2.0), ("partial", 0.9, 4.0), ("failed", None, 6.0), ("skipped", None, 0.0))}}}]
    summaries[0]["summary"]["averaging"]["rounds"][0]["group_size"] = 3
    summaries[0]["summary"]["averaging"]["rounds"][1]["group_size"] = 2
    result = _averaging(summaries, [])
    assert result["rounds"] == 3 and result["no_group"] == 1  # skipped rounds did not run
    assert result["failed_pct"] == pytest.approx(66.67)
    assert result["completeness_mean"] == pytest.approx(0.95)  # over the all-reduces that ran
    assert result["completeness_mean_all"] == pytest.approx((1.0 + 0.9 + 0.0) / 3, abs=1e-4)
    assert result["duration_mean_s"] == 4.0
    for i, finished in enumerate((100.0, 100.0, 111.0)):
        summaries[0]["summary"]["averaging"]["rounds"][i]["finished_at"] = finished
    cut = _averaging(summaries, [], stopped_at=110.0)
    assert cut["rounds"] == 2 and cut["cut_by_stop"] == 1, "the failed round ended after the stop: not judged"
    assert _averaging(summaries, [], stopped_at=90.0)["cut_by_stop"] == 2, "a complete round is never cut"


def test_the_plan_predicts_pipeline_and_averaging_bytes_by_role():
    body = plan_traffic(load_run_config("surrogate-8b")).stage(1)
    counters = {"forward_requests": 10, "backward_requests": 10}
    one_round = [{"status": "complete", "group_size": 4}]
    contributor = predicted_bytes(body, counters, one_round, reducer=False, reducers=2)
    assert contributor["sent"] == 10 * (body.forward_bytes_out + body.backward_bytes_out) + body.round_bytes(4)
    reducer = predicted_bytes(body, counters, one_round, reducer=True, reducers=2)
    # half the buffer to the other reducer, then its reduced half back to the three others
    assert reducer["sent"] - 10 * (body.forward_bytes_out + body.backward_bytes_out) == \
        round(body.round_bytes(4) / 2 + body.round_bytes(4) * 3 / 2)
    failed = predicted_bytes(body, {}, [{"status": "failed", "group_size": 4}], reducer=True, reducers=2)
    assert failed == {"sent": 0, "received": 0}


def test_a_step_round_cut_by_the_stop_is_predicted_as_a_round_of_the_group():
    listed = [{"kind": "step", "status": "complete", "group_size": 4}] * 3
    summary = {"local_step": 24, "averaging": {"rounds": listed}}
    assert rounds_cut_by_stop(summary, 6) == [{"status": "cut_by_stop", "group_size": 4}]
    assert rounds_cut_by_stop({**summary, "local_step": 23}, 6) == []  # round 4 was not due yet
    assert rounds_cut_by_stop({"local_step": 24, "averaging": {"rounds": []}}, 6) == []  # no group ever formed
    body = plan_traffic(load_run_config("surrogate-8b")).stage(1)
    cut = predicted_bytes(body, {}, rounds_cut_by_stop(summary, 6), reducer=False, reducers=2)
    assert cut == {"sent": body.round_bytes(4), "received": body.round_bytes(4)}


def test_a_replay_into_the_same_directory_starts_from_nothing(tmp_path):
    """A second play into the same directory used to reuse the first run's node data: the
    authorizer refused its database ("belongs to run ...") and the lab stalled."""
    from node.netlab.scenario import ScenarioRunner

    scenario, base = load_scenario(os.path.join(SCENARIOS, "smoke.yaml"))
    out = tmp_path / "out"
    (out / "auth").mkdir(parents=True)
    (out / "auth" / "authorizer.db").write_text("an earlier run's")
    (out / "run.yaml").write_text("run_id: lab-smoke-1\n")
    runner = ScenarioRunner(scenario, base, str(out), say=lambda line: None)
    runner._fresh_out_dir()
    assert out.is_dir() and list(out.iterdir()) == []
    stranger = tmp_path / "notes"
    stranger.mkdir()
    (stranger / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="holds no earlier lab run"):
        ScenarioRunner(scenario, base, str(stranger), say=lambda line: None)._fresh_out_dir()
    assert (stranger / "mine.txt").read_text() == "keep"


def test_the_cli_refuses_an_out_directory_of_other_files_in_one_line(tmp_path, capsys):
    import signal

    from node.netlab.cli import main

    (tmp_path / "mine.txt").write_text("keep")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:  # main() installs the lab's own handlers
        assert main(["run", os.path.join(SCENARIOS, "smoke.yaml"), "--out", str(tmp_path)]) == 2
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert err.startswith("netlab: ") and "holds no earlier lab run" in err and "Traceback" not in err
    assert (tmp_path / "mine.txt").read_text() == "keep"
