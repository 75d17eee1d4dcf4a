"""A short lab scenario in the normal suite: real nodes in namespaces behind a shaped link, one
preempted by an operator order mid-round. The shaping must be real (measured against nominal),
the others must keep training and averaging, and the teardown must leave nothing behind."""

from __future__ import annotations

import os

import pytest

from node.netlab.scenario import ScenarioRunner, load_scenario

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.integration

SMOKE = os.path.join(ROOT, "scenarios", "smoke.yaml")


def _lab_missing() -> str | None:
    if os.geteuid() != 0:
        return "the network lab needs root (namespaces, TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "the network lab needs /dev/net/tun"
    return None


@pytest.mark.timeout(400)
def test_smoke_scenario_is_shaped_survives_a_preemption_and_leaves_nothing(tmp_path, node_popen):
    missing = _lab_missing()
    if missing:
        pytest.skip(missing)
    from node.netlab.cleanup import list_netns, list_root_devices, switch_processes
    from node.netlab.plan import PREFIX, lab_id_of

    scenario, base = load_scenario(SMOKE, {"subnet": "10.171.0.0/16"})  # beside a lab someone runs on 10.77
    result = ScenarioRunner(scenario, base, str(tmp_path / "out"), popen=node_popen).run()

    link = result["links"][0]
    # the shaper sets the shortest round trip; a loaded host only adds to the others (the median
    # was measured 27% long under the full suite), so the fastest one is held to nominal, and the
    # median may not fall short of it: a delay that is not applied shows in both
    assert abs(link["rtt_min_ms"] - link["nominal_rtt_ms"]) <= 0.2 * link["nominal_rtt_ms"], link
    assert link["rtt_ms"] >= 0.8 * link["nominal_rtt_ms"], link
    assert abs(link["throughput_mbit"] - link["nominal_mbit"]) <= 0.2 * link["nominal_mbit"], link

    preempted = [d for d in result["deaths"] if d["node"] == "w1b"]
    assert preempted and preempted[0]["how"] == "preempted" and preempted[0]["exit"] == -9, result["timeline"]
    with open(tmp_path / "out" / "w1b.log", errors="replace") as f:
        assert "preempted by operator order" in f.read()

    accounting = result["accounting"]
    assert accounting["samples_completed"] > 0 and accounting["unaccounted"] == 0, accounting
    died_at = preempted[0]["t_s"]
    survivors = [r for r in result["averaging"]["detail"] if r["node"] in ("w1a", "w1c")]
    assert survivors, "the surviving stage-1 replicas ran no averaging round"
    assert any(r["status"] == "complete" and r["group_size"] >= 2 for r in survivors), survivors
    assert result["traffic"]["w1b"], "the switch counted no traffic for the shaped host"
    assert died_at > 0
    lab_id = result["lab_id"]
    assert [n for n in list_netns() if lab_id_of(PREFIX, n) == lab_id] == []
    assert [d for d in list_root_devices() if lab_id_of(PREFIX, d) == lab_id] == []
    assert [pid for pid, owner in switch_processes().items() if owner == lab_id] == []
