"""An open run has no authorizer handing every node the same run config. A node started with a
file of another model construction (same run id, same shapes on the wire) is refused in one
sentence, worker or trainer, and the run's own nodes train on undisturbed."""

from __future__ import annotations

import signal

import pytest

from protocol.exit_codes import ExitCode
from protocol.run_config import dump_run_config, load_run_config

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_nodes_of_another_construction_are_refused_in_one_sentence(make_swarm, run_config_path, tmp_path):
    ours = run_config_path()
    theirs = str(tmp_path / "theirs.yaml")
    dump_run_config(load_run_config(ours, {"model": {"construction": "fixed-embedding"}}), theirs)
    swarm = make_swarm(ours)
    head = swarm.start("worker", stage=0)
    body = swarm.start("worker", stage=1, wait_ready=False)
    tail = swarm.start("worker", stage=2, wait_ready=False)
    for node in (body, tail):
        swarm.wait_ready(node)

    ours_digest, theirs_digest = load_run_config(ours).model_digest, load_run_config(theirs).model_digest
    for role, stage in (("worker", 1), ("trainer", None)):
        stranger = swarm.start(role, stage=stage, args=["--config", theirs], wait_ready=False, name=f"other-{role}")
        assert swarm.wait(stranger, 60) == ExitCode.USAGE, stranger.log_tail()
        log = stranger.log_tail(200)
        assert "Traceback" not in log, log
        refusal = [line for line in log.splitlines() if "train another model" in line]
        assert len(refusal) == 1, log
        assert theirs_digest in refusal[0] and ours_digest in refusal[0], refusal
        assert "construction 'stage-anchors', this config 'fixed-embedding'" in refusal[0]

    trainer = swarm.start("trainer", args=["--max-samples", "32", "--discovery-period-s", "1"])
    assert swarm.wait(trainer, 120) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_completed"] == 32 and summary["samples_dropped"] == 0, summary
    assert "workers_other_model" not in summary
    for node in (head, body, tail):
        assert swarm.stop(node, signal.SIGTERM) == 0, node.log_tail()
