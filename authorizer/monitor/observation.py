"""One look at the run through the DHT: every peer's records with their expiry, the tombstones,
the trainers' reports, and what this node's validator refused since the last look.

The records are read the way nodes read them (hivemind's `get(latest=True)`, validated by our
record validator in the DHT process, each value checked again against its model here), but with
their expiration times kept: a record whose expiration stops moving belongs to a node that stopped
refreshing it (authorizer.monitor.membership).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import ValidationError

from protocol.codec import unpack
from protocol.dht_schema import (
    AveragingRecord, ProgressRecord, RecordModel, TrainerRecord, WorkerRecord, averaging_key, progress_key,
    trainers_key, workers_key,
)
from protocol.records import RecordRejection, drain_observations

logger = logging.getLogger("agora.monitor")


@dataclass
class Sighting:
    """A peer seen announcing itself: a worker under `{run}/stage/{s}/workers`, or a trainer."""

    peer_id: str
    role: str
    stage: Optional[int]
    expiration: float
    worker: Optional[WorkerRecord] = None
    progress: Optional[ProgressRecord] = None
    averaging: Optional[AveragingRecord] = None
    trainer: Optional[TrainerRecord] = None


@dataclass
class Observation:
    t: float
    sightings: dict[str, Sighting] = field(default_factory=dict)
    tombstoned: set[str] = field(default_factory=set)
    trainer_reports: dict[str, TrainerRecord] = field(default_factory=dict)
    """The newest report of every trainer visible now: read from the DHT or witnessed by our
    validator. A trainer that leaves writes a `final` report instead of a tombstone: it is counted,
    and the trainer is gone."""
    rejections: list[RecordRejection] = field(default_factory=list)
    rejections_dropped: int = 0
    complete: bool = True
    """False when a read timed out: absent records then prove nothing (no node is marked gone)."""


class _Timeout(Exception):
    pass


async def _get(dht, key: str, timeout_s: float) -> dict[str, tuple[Any, float]]:
    """{subkey: (value, expiration)} under `key`, expired ones left out; _Timeout if no answer."""
    future = dht.get(key, latest=True, return_future=True)
    try:
        found = await asyncio.wait_for(future, timeout_s)
    except asyncio.TimeoutError:
        future.cancel()
        raise _Timeout(key) from None
    if found is None or not isinstance(found.value, dict):
        return {}
    now = time.time()
    return {subkey: (item.value, float(item.expiration_time)) for subkey, item in found.value.items()
            if isinstance(subkey, str) and item.expiration_time >= now}


def _parse(value: Any, model: type[RecordModel]) -> Optional[RecordModel]:
    try:
        return model.model_validate(value)
    except ValidationError:
        return None


def _is_tombstone(value: Any) -> bool:
    return isinstance(value, dict) and value.get("tombstone") is True


async def observe(dht, run_id: str, num_stages: int, *, validator_token: Optional[str],
                  timeout_s: float = 10.0) -> Observation:
    """Read every key of the run at once (one traversal each, concurrently) and what the
    validator refused meanwhile."""
    obs = Observation(t=time.time())
    keys = [trainers_key(run_id)]
    for stage in range(num_stages):
        keys += [workers_key(run_id, stage), progress_key(run_id, stage), averaging_key(run_id, stage)]
    results = await asyncio.gather(*(_get(dht, key, timeout_s) for key in keys), return_exceptions=True)
    found: dict[str, dict[str, tuple[Any, float]]] = {}
    for key, result in zip(keys, results):
        if isinstance(result, BaseException):
            obs.complete = False
            logger.warning("reading %s from the DHT failed (%s); this snapshot marks no node gone",
                           key, type(result).__name__)
            found[key] = {}
        else:
            found[key] = result
    for stage in range(num_stages):
        progress = found[progress_key(run_id, stage)]
        averaging = found[averaging_key(run_id, stage)]
        for peer, (value, expiration) in found[workers_key(run_id, stage)].items():
            if _is_tombstone(value):
                obs.tombstoned.add(peer)
                continue
            record = _parse(value, WorkerRecord)
            if record is None:
                continue
            sighting = Sighting(peer, "worker", stage, expiration, worker=record)
            if peer in progress and not _is_tombstone(progress[peer][0]):
                sighting.progress = _parse(progress[peer][0], ProgressRecord)
            if peer in averaging and not _is_tombstone(averaging[peer][0]):
                sighting.averaging = _parse(averaging[peer][0], AveragingRecord)
            obs.sightings[peer] = sighting
    for peer, (value, expiration) in found[trainers_key(run_id)].items():
        if _is_tombstone(value):
            obs.tombstoned.add(peer)
            continue
        record = _parse(value, TrainerRecord)
        if record is not None:
            obs.trainer_reports[peer] = record
            if record.final:  # the trainer left; its last counters are still counted
                obs.tombstoned.add(peer)
            else:
                obs.sightings.setdefault(peer, Sighting(peer, "trainer", None, expiration, trainer=record))
    if validator_token is not None:
        await _drain(dht, validator_token, obs, timeout_s)
    return obs


async def _drain(dht, token: str, obs: Observation, timeout_s: float) -> None:
    future = dht.run_coroutine(functools.partial(drain_observations, token=token), return_future=True)
    try:
        drained = await asyncio.wait_for(future, timeout_s)
    except asyncio.TimeoutError:
        future.cancel()
        logger.warning("the DHT process did not hand over its rejected records within %.0f s", timeout_s)
        return
    except Exception as exc:  # the DHT process failed the call: the next snapshot tries again
        logger.warning("could not fetch the rejected records from the DHT process: %s", exc)
        return
    obs.rejections = [RecordRejection(**item) for item in drained.get("rejections", [])]
    obs.rejections_dropped = int(drained.get("dropped", 0))
    for peer, (_, body) in drained.get("trainer_reports", {}).items():
        try:
            record = TrainerRecord.model_validate(unpack(body))
        except Exception:  # our own validator accepted it; a decoding failure here is not the peer's
            continue
        current = obs.trainer_reports.get(peer)
        if current is None or record.time > current.time:
            obs.trainer_reports[peer] = record
