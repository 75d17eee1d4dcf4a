"""The reducer election (roles/worker/averaging/election.py): every replica that reads the same
records elects the same workers, whatever order it read them in."""

from __future__ import annotations

import itertools

from roles.worker.averaging.election import Candidate, elect

T0 = 1_800_000_000.0  # a wall-clock time on a minute boundary


def test_a_stage_with_enough_reducers_elects_nobody():
    candidates = [Candidate("a", T0, 0.0), Candidate("b", T0, 0.0)]
    assert elect({"r"}, candidates, 1) == []
    assert elect(set(), candidates, 0) == []


def test_the_longest_running_worker_is_elected_first():
    candidates = [Candidate("new", T0 + 600, 9e9), Candidate("old", T0, 0.0), Candidate("mid", T0 + 120, 1e6)]
    assert elect(set(), candidates, 1) == ["old"]
    assert elect(set(), candidates, 2) == ["old", "mid"]
    assert elect({"old"}, candidates, 2) == ["mid"], "only the missing reducers are elected"


def test_workers_started_in_the_same_minute_are_ranked_by_bandwidth_then_peer_id():
    candidates = [Candidate("b", T0 + 5, 1e6), Candidate("a", T0 + 50, 1e6), Candidate("c", T0 + 1, 5e6)]
    assert elect(set(), candidates, 3) == ["c", "a", "b"]


def test_every_reading_order_elects_the_same_workers():
    candidates = [Candidate(p, T0 + 30 * i, float(i % 2)) for i, p in enumerate("pqrstu")]
    results = {tuple(elect(set(), list(order), 2)) for order in itertools.permutations(candidates)}
    assert len(results) == 1


def test_more_wanted_than_candidates_elects_them_all():
    assert elect(set(), [Candidate("a", T0, 0.0)], 3) == ["a"]
    assert elect(set(), [], 1) == []


def test_a_record_claiming_an_infinite_start_or_bandwidth_is_rejected():
    import pytest
    from pydantic import ValidationError

    from protocol.dht_schema import AveragingRecord

    for field in ("started_at", "bandwidth"):
        for value in (float("inf"), float("nan"), -1.0):
            with pytest.raises(ValidationError):
                AveragingRecord.model_validate({field: value})
