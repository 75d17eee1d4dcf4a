"""The human exit summary, made from real summary dicts (captured from a 3-stage tiny run with two
replicas of stage 0), from variants with drops and averaging, and from partial ones."""

from __future__ import annotations

import copy

import pytest

from node.summary import human_summary

TRAINER = {
    "samples_started": 96, "samples_completed": 96, "samples_dropped": 0, "samples_in_flight": 0,
    "dropped_by_reason": {}, "tokens": 6144, "first_loss": 5.575824618339539, "last_loss": 5.3045371770858765,
    "last_step": 5, "wall_s": 1.838, "tokens_per_s": 3342.92, "forward_retries": 0, "backward_fallbacks": 0,
    "served": {"0": {"12D3KooWDfTFwuU9qTq7g69yNEb8e36G6mUFE2pqQtrQLnX4fNew": 45,
                     "12D3KooWBgqNiRZa4ZP6fGB6HXgKVW7ifMZsxLhGY9mubLSA85ML": 51},
               "1": {"12D3KooWCNYt2R65LQLwMbpSTJK3WApWkxY4BQETg3cwskA6odf7": 96},
               "2": {"12D3KooWN7oXxcZ56pyqx9HP7uQRjtXB4xwFACtiAsREXHCjCmtm": 96}},
}

WORKER = {
    "stage": 0, "local_step": 6, "phase": "active",
    "counters": {"forward_requests": 45, "forward_batches": 40, "backward_unpinned": 0, "backward_requests": 45,
                 "backward_batches": 44},
    "rejected": {}, "auth_rejected": {}, "compute_s": 0.498,
    "steps": {"taken": 6, "samples_per_step_mean": 16.0, "samples_per_step_max": 16, "samples_per_step_min": 16,
              "short_steps": 0, "long_steps": 0, "closed_by": {"complete": 5, "peer_ahead": 1}, "late_samples": 0,
              "abandoned_samples": 0, "steps_skipped": 0, "discarded_at_shutdown": 0, "discarded_by_step": {}},
    "staleness": {"samples": 45, "mean_gap": 0.0, "max_gap": 0, "stale_share": 0.0, "pinned": 5,
                  "mean_delay": 0.2222, "max_delay": 1, "delayed_share": 0.2222, "delays": {"0": 35, "1": 10}},
    "mean_batch_size": 1.071,
    "joined": {"stage_step": 0, "loaded_step": 0, "source": "seed", "phase": "active"},
    "sync_phases": [{"phase": "active", "from_step": 0, "to_step": None,
                     "reason": "the stage has not stepped yet: every replica starts from the seed",
                     "forward_requests": None, "backward_requests": None}],
    "averaging": {"state": "stopped", "reducer": False, "counters": {}, "rounds": []},
    "state_served": {},
}


def test_trainer_summary_reads_as_a_few_lines():
    text = human_summary("trainer", TRAINER)
    assert text.splitlines() == [
        "trainer done after 1.8 s of training: 96 samples completed (6144 tokens), 0 dropped",
        "  loss 5.576 -> 5.305 (5% lower), 3343 tokens/s, last step 5",
        "  workers used per stage [2, 1, 1]",
    ]


def test_trainer_summary_shows_the_last_heldout_loss():
    summary = {**TRAINER, "eval": [{"step": 0, "loss": 5.6, "samples": 32}, {"step": 40, "loss": 4.25, "samples": 32}]}
    lines = human_summary("trainer", summary).splitlines()
    assert lines[1] == "  loss 5.576 -> 5.305 (5% lower), held-out loss 4.250 at step 40, 3343 tokens/s, last step 5"
    assert all(len(line) <= 100 for line in lines)


def test_trainer_summary_names_drops_by_reason_and_retries():
    summary = {**TRAINER, "samples_dropped": 109, "dropped_by_reason": {"timeout": 12, "no_workers": 97},
               "forward_retries": 7, "backward_fallbacks": 2, "samples_in_flight": 3}
    lines = human_summary("trainer", summary).splitlines()
    assert "109 dropped, 3 still in flight" in lines[0]
    assert lines[2] == "  workers used per stage [2, 1, 1], 7 forward retries, 2 backward fallbacks"
    assert lines[3] == "  dropped: 97 no_workers, 12 timeout"


def test_worker_summary_reads_as_a_few_lines():
    text = human_summary("worker", WORKER, uptime_s=73.2)
    assert text.splitlines() == [
        "worker of stage 0 done after 1 min 13 s: 6 steps taken, phase active, 0.5 s computing",
        "  45 forward samples in 40 batches, 45 backward samples in 44 batches, mean batch 1.07",
        "  16 samples per step; steps closed: 5 complete, 1 peer_ahead",
        "  averaging: no rounds",
        "  staleness: gradient delay 0.22 steps on average (max 1), 22% of samples delayed",
    ]


def test_worker_summary_counts_averaging_rounds_and_rejections():
    summary = copy.deepcopy(WORKER)
    summary["averaging"] = {"state": "idle", "reducer": True, "rounds": [],
                            "counters": {"rounds_complete": 3, "rounds_skipped": 2, "rounds_failed": 1,
                                         "index_set_mismatches": 4}}
    summary["rejected"] = {"malformed": 2}
    summary["auth_rejected"] = {"expired": 1}
    summary["steps"]["discarded_at_shutdown"] = 5
    text = human_summary("worker", summary)
    assert "  averaging: 6 rounds (3 complete, 1 failed, 2 skipped), as a reducer" in text.splitlines()
    assert "  rejected requests: 2 malformed, 1 expired" in text.splitlines()
    assert "5 discarded at shutdown" in text
    summary["rejected_calls"] = {"agora/v1/tags not_ready": 1, "agora/v1/forward malformed": 2}
    text = human_summary("worker", summary)
    assert "  rejected requests: 2 forward malformed, 1 tags not_ready, 1 expired" in text.splitlines()
    summary["averaging"]["evidence"] = {"upheld": 1, "already_revoked": 2, "failed": 0}
    text = human_summary("worker", summary)
    assert ("  averaging: 6 rounds (3 complete, 1 failed, 2 skipped), as a reducer, evidence reported: "
            "2 already_revoked, 1 upheld") in text.splitlines()


@pytest.mark.parametrize("role, summary", [
    ("trainer", {}), ("worker", {}), ("trainer", {"first_loss": None, "last_loss": None, "wall_s": 0.0}),
    ("worker", {"steps": None, "counters": None, "staleness": {"samples": 0}, "averaging": "?"}),
    ("trainer", {**TRAINER, "served": {"0": "?"}, "dropped_by_reason": None, "first_loss": 0.0}),
    ("trainer", {**TRAINER, "eval": "?"}), ("trainer", {**TRAINER, "eval": [{"loss": None}, {"step": None, "loss": 2}]}),
    ("authorizer", {}),
])
def test_partial_summaries_still_give_a_line(role, summary):
    text = human_summary(role, summary)
    assert text.startswith(f"{role}") and "None" not in text and not text.endswith("\n")


def test_every_line_is_short():
    for role, summary in (("trainer", TRAINER), ("worker", WORKER)):
        assert all(len(line) <= 100 for line in human_summary(role, summary, uptime_s=3600).splitlines())
