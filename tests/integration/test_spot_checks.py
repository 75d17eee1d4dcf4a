"""Spot checks with real processes: a worker whose process scales its outputs by 3, or flips
the gradients it sends back (the adversary harness, tests/support/adversary_node.py), disagrees
with its stage's other replica; the trainer's re-execution on each side's weights (or the
gradients' slopes, or a third replica) puts it in the wrong, and the trainer stops routing to it;
honest replicas agree exactly. (A worker adding noise, which contradicts itself when asked again,
is run on the workers path: tests/integration/test_chain_spot_checks.py.)"""

import json
import signal

import pytest

from tests.support.adversary_node import adversary_prefix

pytestmark = pytest.mark.integration

THREE_STAGES = [{"first_layer": 0, "last_layer": 1}, {"first_layer": 1, "last_layer": 2},
                {"first_layer": 2, "last_layer": 3}]
SAMPLES = 240


@pytest.mark.parametrize("attack,honest_replicas", [("scale:3", 1), ("flip_grad", 1), ("scale:3", 2)])
def test_spot_checks_find_and_exclude_a_cheating_worker(make_swarm, run_config_path, attack, honest_replicas):
    config = run_config_path(stages=THREE_STAGES, verification={"spot_check_rate": 0.3})
    swarm = make_swarm(config)
    first = swarm.start("worker", stage=0)
    workers = [swarm.start("worker", stage=stage, wait_ready=False) for stage in (0, *[1] * honest_replicas, 2, 2)]
    # it also answers the checks it is asked to run falsely (held-out evaluations are altered too)
    cheater = swarm.start("worker", stage=1, wait_ready=False, prefix=adversary_prefix(attack))
    for node in [*workers, cheater]:
        swarm.wait_ready(node, timeout_s=180)
    trainer = swarm.start("trainer", args=["--lanes", "4", "--max-samples", str(SAMPLES)])
    assert trainer.proc.wait(timeout=300) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_completed"] == SAMPLES, summary
    checks = summary["spot_checks"]
    print(json.dumps(checks, indent=1))
    cheater_id = cheater.maddrs[0].rsplit("/p2p/", 1)[1]
    # one dispute a re-execution decides excludes it (verification.exact_strikes_to_exclude)
    assert checks["disputed"] >= 1, checks
    for dispute in checks["disputes"]:
        assert dispute["stage"] == 1 and cheater_id in (dispute["worker"], dispute["checker"]), dispute
        assert dispute["kind"] == ("gradient" if attack == "flip_grad" else "output"), dispute
    # the honest pairs (stages 0 and 2) agree to the last bit
    assert checks["agreed"] >= 10 and checks["largest_agreed_distance"] == 0.0, checks
    # the losses (or a third replica) resolved disputes against the cheater only, and it was cut off
    assert set(checks["strikes"]) == {cheater_id} and set(checks["excluded"]) == {cheater_id}, checks
    decided = [d for d in checks["disputes"] if d["struck"]]
    if honest_replicas > 1:  # a third replica is there to re-execute: it decides, at distance 0 from the truth
        assert decided and all(d["arbiter"] not in (None, cheater_id) for d in decided), decided
    elif attack == "scale:3":  # two replicas, a lie the loss barely sees: the trainer re-executes the hop itself
        assert checks["strikes_by_mechanism"][cheater_id].get("reexecuted", 0) >= 1, checks
        assert "distance from what its own weights compute" in checks["excluded"][cheater_id], checks
        assert checks["referee"]["verdicts"] >= 1 and checks["referee"]["forged"] == 0, checks
    served = summary["served"]["1"]
    in_flight = 4  # the lanes: samples already past it when it was excluded still complete
    assert served[cheater_id] <= checks["served_before_exclusion"][cheater_id] + in_flight, (served, checks)
    assert all(served[cheater_id] < n for peer, n in served.items() if peer != cheater_id), served
    assert first.proc.poll() is None
    # what the cheater served of the steps still open was taken back out of them: at every stage,
    # and at its own from an honest replica, never from the cheater (roles/trainer/retraction.py)
    retraction = checks["retraction"]
    # (on a loaded machine every step may close before its retraction arrives: `too_late`, no failure)
    assert retraction["samples"] > 0 and retraction["failed"] == 0, retraction
    assert retraction["applied"] + retraction["too_late"] > 0, retraction
    applied = {}
    for node in [first, *workers, cheater]:
        assert swarm.stop(node, signal.SIGTERM) == 0, node.log_tail()
        found = node.summary()
        assert found is not None, node.log_tail()
        counters = found["counters"]
        applied[node.name] = counters.get("retractions_applied", 0)
        # only the cheater's stage is asked on its behalf; each correction is counted at its step
        # (summed, or its replica gone) unless the worker stopped before that step closed
        on_behalf = counters.get("retractions_on_behalf", 0)
        assert node.stage == 1 or on_behalf == 0, (node.name, counters)
        settled = sum(counters.get(f"retractions_{k}", 0) for k in ("summed", "replica_gone", "lost_late"))
        assert settled <= on_behalf, (node.name, counters)
    assert applied[cheater.name] == 0 and sum(applied.values()) >= retraction["applied"], (applied, retraction)
