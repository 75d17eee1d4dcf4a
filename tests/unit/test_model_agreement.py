"""Nodes of a run train one model: the run config's model digest, announced in worker records, is
what a joining node and a trainer compare (issue 24: a node of another construction is refused
in one sentence instead of training a different model)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from node.swarm import check_same_model, read_worker_records
from protocol.dht_schema import Phase, WorkerRecord
from protocol.errors import ConfigError
from protocol.run_config import load_run_config
from roles.trainer.balancer import StageBalancer
from roles.trainer.discovery import WorkerDiscovery


def _run(**overrides):
    return load_run_config("tiny", {"run_id": "agree", **overrides})


def _record(stage: int, run=None, phase=Phase.ACTIVE) -> WorkerRecord:
    return WorkerRecord(stage=stage, phase=phase, max_batch=1, throughput=1.0,
                        model_digest=run.model_digest if run is not None else "",
                        construction=run.model.construction if run is not None else "")


class Swarm:
    peer_id = "me"

    def __init__(self, by_stage: dict[int, dict[str, WorkerRecord]]):
        self.by_stage = by_stage

    async def get(self, key, model):
        assert model is WorkerRecord
        stage = int(key.split("/stage/")[1].split("/")[0])
        if self.by_stage.get(stage) is None:
            raise TimeoutError("no DHT peer answered")
        return dict(self.by_stage[stage])


def test_the_digest_covers_what_defines_the_model_and_nothing_else():
    run = _run()
    assert len(run.model_digest) == 16 and run.model_digest == _run().model_digest
    differs = [_run(model={"construction": "fixed-embedding"}), _run(model={"subspace_seed": 7}),
               _run(model={"subspace_rank": 8}),
               _run(stages=[{"first_layer": 0, "last_layer": 1}, {"first_layer": 1, "last_layer": 3}])]
    assert all(other.model_digest != run.model_digest for other in differs)
    same = [_run(optimizer={"lr": 1e-4}), _run(target_batch_size=4), _run(seed=3), _run(run_id="another"),
            _run(checkpoints={"store": "/tmp/somewhere"}), _run(averaging={"method": "sparseloco"})]
    assert all(other.model_digest == run.model_digest for other in same)


def test_a_default_written_out_does_not_change_the_digest():
    """A field a later version adds with a default must not split old and new nodes."""
    implicit = load_run_config("1b")
    explicit = load_run_config("1b", {"model": {"construction": "fixed-embedding", "anchor_rank": None}})
    assert implicit.model_digest == explicit.model_digest


def test_a_node_of_another_model_is_refused_in_one_sentence_naming_the_difference():
    ours, theirs = _run(model={"construction": "fixed-embedding"}), _run()
    swarm = Swarm({0: {"a": _record(0, theirs)}, 1: {"b": _record(1, theirs)}, 2: None})
    records = asyncio.run(read_worker_records(swarm, ours.run_id, ours.num_stages))
    assert [sorted(r) for r in records] == [["a"], ["b"], []], "a stage whose read failed counts as none"
    with pytest.raises(ConfigError) as refused:
        check_same_model(ours, records, swarm.peer_id)
    message = str(refused.value)
    assert "\n" not in message
    assert "2 live worker(s) train another model" in message
    assert theirs.model_digest in message and ours.model_digest in message
    assert "construction 'stage-anchors', this config 'fixed-embedding'" in message
    assert "same run config" in message


def test_a_node_matching_the_run_joins_and_a_minority_of_others_is_only_logged(caplog):
    ours, other = _run(), _run(model={"subspace_seed": 99})
    records = [{"a": _record(0, ours), "x": _record(0, other)}, {"b": _record(1, ours)}, {}]
    with caplog.at_level(logging.WARNING, logger="node.swarm"):
        check_same_model(ours, records, "me")
    assert "1 live worker(s) of run agree train another model" in caplog.text
    assert "the model section or the stage layout differs" in caplog.text


@pytest.mark.parametrize("records", [
    {},  # the first node of a run
    {0: {"me": None}},  # our own earlier record (a restart with a changed file is judged by others)
    {0: {"old": "no-digest"}},  # a worker older than the digest
    {0: {"gone": "leaving"}},  # a worker on its way out
])
def test_nothing_to_compare_with_lets_the_node_join(records):
    ours, theirs = _run(), _run(model={"construction": "fixed-embedding"})
    kinds = {None: _record(0, theirs), "no-digest": _record(0), "leaving": _record(0, theirs, Phase.LEAVING)}
    read = [{peer: kinds[kind] for peer, kind in records.get(stage, {}).items()} for stage in range(ours.num_stages)]
    check_same_model(ours, read, "me")


def test_a_trainer_keeps_workers_of_another_model_off_its_routes_and_names_each_once(caplog):
    ours, theirs = _run(), _run(model={"construction": "fixed-embedding"})
    swarm = Swarm({0: {"good": _record(0, ours), "bad": _record(0, theirs), "old": _record(0)},
                   1: {"tail": _record(1, ours)}, 2: {}})
    balancers = [StageBalancer(stage) for stage in range(ours.num_stages)]
    discovery = WorkerDiscovery(swarm, ours.run_id, balancers, period_s=1.0, model_digest=ours.model_digest)
    with caplog.at_level(logging.WARNING, logger="roles.trainer.discovery"):
        asyncio.run(discovery.refresh())
        asyncio.run(discovery.refresh())
    assert sorted(balancers[0].usable()) == ["good", "old"]
    assert balancers[1].usable() == ["tail"]
    assert discovery.other_model == {"bad"}
    warnings = [r for r in caplog.records if "trains another model" in r.getMessage()]
    assert len(warnings) == 1 and "construction 'fixed-embedding'" in warnings[0].getMessage()
