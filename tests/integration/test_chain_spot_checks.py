"""Spot checks on the workers path (`routing.path: workers`) with real processes: a body worker
that noises its outputs, or flips the gradients it sends back, or a tail that reports three times
its loss (tests/support/adversary_node.py), passes them straight to its neighbours, never through
the trainer; they keep what it sent them, signed, the trainer checks it on the other replica of
its stage, and excludes it from its routes. Honest workers get no strike."""

from __future__ import annotations

import json

import pytest

from tests.support.adversary_node import adversary_prefix

pytestmark = pytest.mark.integration

THREE_STAGES = [{"first_layer": 0, "last_layer": 1}, {"first_layer": 1, "last_layer": 2},
                {"first_layer": 2, "last_layer": 3}]
SAMPLES = 120


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attack,kind,stage", [("noise:1", "output", 1), ("flip_grad", "gradient", 1),
                                               ("loss:3", "loss", 2)])
def test_a_lying_worker_on_the_workers_path_is_checked_through_its_neighbours_and_excluded(
        make_swarm, run_config_path, attack, kind, stage):
    config = run_config_path(stages=THREE_STAGES, routing={"path": "workers"},
                             verification={"spot_check_rate": 0.3})
    swarm = make_swarm(config)
    first = swarm.start("worker", stage=0)
    stages = [0, 1, 1, 2, 2]
    stages.remove(stage)  # two workers a stage, the liar one of them
    honest = [swarm.start("worker", stage=s, wait_ready=False) for s in stages]
    # it lies in the checks it is asked to run too (held-out evaluations are altered as well)
    liar = swarm.start("worker", stage=stage, wait_ready=False, prefix=adversary_prefix(attack))
    for node in [*honest, liar]:
        swarm.wait_ready(node, timeout_s=180)
    trainer = swarm.start("trainer", args=["--lanes", "4", "--max-samples", str(SAMPLES),
                                           "--discovery-period-s", "1"])
    assert swarm.wait(trainer, 180) == 0, trainer.log_tail()
    summary = trainer.summary()
    checks = summary["spot_checks"]
    print(json.dumps({k: v for k, v in checks.items() if k != "screening"}, indent=1))
    assert summary["routing"] == "workers" and summary["samples_completed"] == SAMPLES, summary
    chain = checks["chain"]
    assert chain["handed"] >= 10 and chain.get("unbound", 0) == 0, chain
    assert set(checks["excluded"]) == {liar.peer_id}, checks
    assert set(checks["strikes"]) == {liar.peer_id}, "honest workers get no strike"
    for dispute in checks["disputes"]:
        assert dispute["stage"] == stage and liar.peer_id in (dispute["worker"], dispute["checker"]), dispute
        assert dispute["kind"] == kind, dispute
    # The honest pairs agree to the last bit, through their neighbours' records too.
    assert checks["agreed"] >= 5 and checks["largest_agreed_distance"] == 0.0, checks
    served = summary["served"][str(stage)]
    in_flight = 4  # the lanes: samples already past it when it was excluded still complete
    assert served[liar.peer_id] <= checks["served_before_exclusion"][liar.peer_id] + in_flight, (served, checks)
    assert first.proc.poll() is None
    # The liar's neighbours handed what it sent them; it was asked for nothing of its own hops.
    for node in [first, *honest, liar]:
        swarm.stop(node)
    records = {node.name: node.summary().get("hop_records", {}) for node in [first, *honest, liar]}
    print(json.dumps(records, indent=1))
    assert sum(r.get("served", 0) for r in records.values()) >= chain["fetched"] > 0, records
