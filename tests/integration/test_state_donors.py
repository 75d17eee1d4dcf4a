"""Multi-donor state download with real agora-node processes [issue 22.4]: a joiner fetches its
stage's parameters and optimizer state from two donors at once, one donor is killed mid-transfer,
and the joiner finishes from the other with exactly the donors' state."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors import safe_open

from tests.support.faults_node import faults_prefix
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

TWO_STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]


def _log_has(node, text: str) -> bool:
    return text in node.log_tail(600)


def _tensors(directory) -> dict[str, torch.Tensor]:
    (path,) = [os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".safetensors")]
    with safe_open(path, framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


@pytest.mark.timeout(300)
def test_a_joiner_finishes_from_the_second_donor_when_the_first_is_killed_mid_transfer(make_swarm, run_config_path,
                                                                                      tmp_path):
    # Stage 0 of the tiny model: about 1 MB of parameters and AdamW moments, in 64 KiB chunks. Each
    # donor pauses 1 s before every chunk, so the joiner's download lasts seconds, not milliseconds.
    config = run_config_path(stages=TWO_STAGES, target_batch_size=4,
                             sync={"max_stale_steps": 10_000, "state_chunk_bytes": 1 << 16,
                                   "state_chunk_timeout_s": 5.0})
    slow = faults_prefix(state_chunk_delay_s=1)
    swarm = make_swarm(config)
    first = swarm.start("worker", stage=0, prefix=slow, name="first")
    tail = swarm.start("worker", stage=1, wait_ready=False)
    trainer = swarm.start("trainer", wait_ready=False, args=["--lanes", "2", "--discovery-period-s", "1"])
    swarm.wait_ready(tail)
    swarm.wait_ready(trainer)
    poll_until(lambda: _log_has(first, "stage 0 step 2:"), 90, "stage 0 to step")
    assert swarm.stop(trainer) == 0  # the stage keeps its state from here on

    # The second donor takes the first's state: bit-identical, so both publish one manifest.
    second_dir, joiner_dir = tmp_path / "second", tmp_path / "joiner"
    def checkpoint(directory):  # written as the worker starts serving, then not again during the test
        return ["--checkpoint-dir", str(directory), "--checkpoint-period-s", "3600"]

    second = swarm.start("worker", stage=0, prefix=slow, name="second", args=checkpoint(second_dir), timeout_s=120)
    assert second.summary() is None and _log_has(second, "from 1 donor(s)"), second.log_tail(40)
    poll_until(lambda: second_dir.exists() and any(second_dir.iterdir()), 30, "the second donor's checkpoint")

    joiner = swarm.start("worker", stage=0, wait_ready=False, name="joiner", args=checkpoint(joiner_dir))
    poll_until(lambda: _log_has(joiner, "loading stage 0 state: first chunk"), 90, "the joiner's download to start")
    assert _log_has(joiner, "from 2 donor(s)"), joiner.log_tail(40)
    os.kill(first.pid, signal.SIGKILL)  # mid-transfer, as a crash or an OOM kill would
    swarm.wait_ready(joiner, timeout_s=120)
    poll_until(lambda: joiner_dir.exists() and any(joiner_dir.iterdir()), 30, "the joiner's checkpoint")

    assert swarm.stop(joiner) == 0
    assert swarm.stop(second) == 0
    summary = joiner.summary()
    download = summary["joined"]["download"]
    print("joiner's download:", download)  # run with -s to see which donor served what
    outcomes = {peer: o for peer, o in download["donors"].items()}
    dead = outcomes[first.peer_id[-12:]]
    alive = outcomes[second.peer_id[-12:]]
    assert sum(dead["failures"].values()) >= 1 and dead["chunks"] < download["chunks"], download
    assert alive["chunks"] >= download["chunks"] - dead["chunks"] and alive["dropped"] is None, download
    assert second.summary()["state_served"]["donor_chunks_served"] == alive["chunks"]

    # The joiner holds exactly the donors' parameters (its checkpoint, written as it started serving).
    mine, theirs = _tensors(joiner_dir), _tensors(second_dir)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    assert summary["joined"]["loaded_step"] == summary["joined"]["stage_step"] >= 2
