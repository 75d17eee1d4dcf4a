"""Divergence (roles/worker/averaging/divergence.py): a replica far from the average while the
others are not is the outlier and must resync after `rounds` rounds in a row (of a diverged pair,
the newcomer); a stage of three or more whose members are all far apart is reported, never resynced."""

from __future__ import annotations

from protocol.dht_schema import AveragingRecord, RoundStatus, RoundSummaryRecord
from roles.worker.averaging.divergence import DivergenceWatch


def _record(round_id: int, distance, status=RoundStatus.COMPLETE, kind="step", started_at=0.0) -> AveragingRecord:
    summary = RoundSummaryRecord(kind=kind, round=round_id, segment=0, digest="d", status=status, group_size=3,
                                 expected_group_size=3, duration_s=1.0, weight=1.0, relative_distance=distance)
    return AveragingRecord(recent=[summary], started_at=started_at)


def test_an_outlier_resyncs_after_two_rounds_in_a_row():
    watch = DivergenceWatch(0.25, rounds=2)
    watch.observe("step", 1, RoundStatus.COMPLETE, 0.9, group_size=3)
    first = watch.judge([_record(1, 0.45), _record(1, 0.44)])
    assert first.outlier and first.diverged and not watch.must_resync()
    watch.observe("step", 2, RoundStatus.COMPLETE, 0.8, group_size=3)
    assert watch.judge([_record(2, 0.4), _record(2, 0.41)]).outlier
    assert watch.must_resync()
    watch.reset()
    assert not watch.must_resync() and watch.pending is None


def test_a_round_in_range_resets_the_streak():
    watch = DivergenceWatch(0.25, rounds=2)
    watch.observe("step", 1, RoundStatus.COMPLETE, 0.9, group_size=3)
    watch.judge([_record(1, 0.1)])
    watch.observe("step", 2, RoundStatus.COMPLETE, 0.01, group_size=3)
    assert not watch.judge([_record(2, 0.01)]).diverged
    watch.observe("step", 3, RoundStatus.COMPLETE, 0.9, group_size=3)
    watch.judge([_record(3, 0.1)])
    assert not watch.must_resync()


def test_a_stage_far_apart_everywhere_has_no_outlier():
    """Two replicas sit equally far from their average; three from three seeds nearly so."""
    watch = DivergenceWatch(0.25, rounds=1)
    watch.observe("step", 1, RoundStatus.COMPLETE, 0.7, group_size=2)
    judged = watch.judge([_record(1, 0.7)])
    assert judged.diverged and not judged.outlier and not watch.must_resync()


def test_of_two_diverged_replicas_the_newcomer_resyncs():
    """Two replicas are symmetric, so the one whose averaging began later gives way [issue 20]."""
    newcomer, elder = DivergenceWatch(0.25, rounds=1), DivergenceWatch(0.25, rounds=1)
    newcomer.observe("step", 1, RoundStatus.COMPLETE, 0.7, group_size=2)
    elder.observe("step", 1, RoundStatus.COMPLETE, 0.7, group_size=2)
    assert newcomer.judge([_record(1, 0.7, started_at=100.0)], started_at=200.0, stage_size=2).outlier
    assert newcomer.must_resync()
    assert not elder.judge([_record(1, 0.7, started_at=200.0)], started_at=100.0, stage_size=2).outlier
    assert not elder.must_resync()
    close = DivergenceWatch(0.25, rounds=1)
    close.observe("step", 2, RoundStatus.COMPLETE, 0.1, group_size=2)
    assert not close.judge([_record(2, 0.1, started_at=100.0)], started_at=200.0, stage_size=2).outlier, \
        "not diverged"
    # A round of two in a stage of three is no pair: the third may side with either.
    of_three = DivergenceWatch(0.25, rounds=1)
    of_three.observe("step", 3, RoundStatus.COMPLETE, 0.7, group_size=2)
    assert not of_three.judge([_record(3, 0.7, started_at=100.0)], started_at=200.0, stage_size=3).outlier


def test_only_rounds_the_others_reported_are_judged():
    watch = DivergenceWatch(0.25, rounds=1)
    watch.observe("step", 1, RoundStatus.COMPLETE, 0.9, group_size=3)
    assert watch.judge([_record(0, 0.01), _record(1, None, status=RoundStatus.FAILED), _record(1, 0.1, kind="clock")]) \
        is None, "another round, a failed one, another kind"
    assert watch.pending is not None, "still waiting for the others' reports"
    watch.observe("step", 2, RoundStatus.FAILED, None, group_size=3)
    assert watch.pending[1] == 1, "a failed round of ours is not judged"
    watch.observe("step", 3, RoundStatus.COMPLETE, 0.9, group_size=1)
    assert watch.pending[1] == 1, "nor one we averaged alone"


def test_judging_off():
    watch = DivergenceWatch(None, rounds=1)
    watch.observe("step", 1, RoundStatus.COMPLETE, 0.9, group_size=3)
    assert watch.judge([_record(1, 0.0)]) is None
