"""Worker discovery through reads that find nothing: a loaded host's DHT lookup can come back empty
without a timeout, and a trainer that believed it dropped every sample of the stage as
`no_workers` until the next read."""

import asyncio

from protocol.dht_schema import Phase
from roles.trainer import discovery as discovery_module
from roles.trainer.balancer import StageBalancer
from roles.trainer.discovery import WorkerDiscovery
from tests.unit.test_model_agreement import Swarm, _record, _run


def test_an_empty_read_keeps_the_workers_found_a_record_lifetime_ago(monkeypatch):
    run = _run()
    swarm = Swarm({0: {"a": _record(0, run), "b": _record(0, run)}, 1: {"t": _record(1, run)}, 2: {}})
    balancers = [StageBalancer(stage) for stage in range(run.num_stages)]
    discovery = WorkerDiscovery(swarm, run.run_id, balancers, period_s=1.0, model_digest=run.model_digest)
    clock = [1000.0]
    monkeypatch.setattr(discovery_module.time, "monotonic", lambda: clock[0])
    asyncio.run(discovery.refresh())
    assert sorted(balancers[0].usable()) == ["a", "b"]

    swarm.by_stage[0] = {}  # the lookup comes back empty
    clock[0] += 10
    asyncio.run(discovery.refresh())
    assert sorted(balancers[0].usable()) == ["a", "b"] and discovery.empty_reads == 1

    clock[0] += discovery_module.EMPTY_READ_GRACE_S  # longer than any record lives: they are gone
    asyncio.run(discovery.refresh())
    assert balancers[0].usable() == [] and discovery.workers_per_stage()[0] == 0

    # a read that finds records, even none routable, is believed at once
    swarm.by_stage[1] = {"t": _record(1, run, Phase.LEAVING)}
    asyncio.run(discovery.refresh())
    assert balancers[1].usable() == []
