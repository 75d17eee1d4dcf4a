"""scripts/bench_trust.py's reading of a finished run: who excluded the attacker after how many
samples, who else was accused and by which mechanism, the own-order reference, and the table over
runs (the swarm itself is stood in for)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_trust  # noqa: E402

ATTACKER, HONEST = "12D3KooWattacker00000000", "12D3KooWhonest000000000"


def _trainer(excluded: dict, served_before: dict, served: dict, struck=()) -> dict:
    return {"samples_completed": 80, "served": {"1": served},
            "spot_checks": {"excluded": excluded, "served_before_exclusion": served_before,
                            "strikes": {p: 3 for p in struck}, "disputes": [{"struck": p} for p in struck],
                            "strikes_by_mechanism": {p: {"arbiter": 3} for p in struck}}}


def _swarm(tmp_path, trainers: dict) -> dict:
    return {"summaries": trainers, "peer_ids": {"worker-s1-r1": ATTACKER, "worker-s1-r0": HONEST},
            "checkpoint_dirs": [str(tmp_path / "r0"), str(tmp_path / "r1")], "train_wall_s": 10.0, "errors": []}


@pytest.fixture
def run():
    return bench_trust.trust_run_config(bench_trust.parse_args(["--steps", "10"]), 10, checks=True)


def test_samples_to_exclusion_add_up_over_trainers_only_once_every_trainer_excluded(tmp_path, run):
    both = _swarm(tmp_path, {
        "trainer-0": _trainer({ATTACKER: "3 disputes"}, {ATTACKER: 8}, {ATTACKER: 11, HONEST: 69}, [ATTACKER]),
        "trainer-1": _trainer({ATTACKER: "3 disputes"}, {ATTACKER: 16}, {ATTACKER: 18, HONEST: 62}, [ATTACKER]),
    })
    figures = bench_trust._figures(run, both, {"worker-s1-r1": ["noise:1"]}, 160)
    assert figures["samples_to_exclusion"] == {"worker-s1-r1": 24}
    assert figures["excluded_by_every_trainer"] and figures["false_accusations"] == []
    # no final checkpoints were written: said, not hidden
    assert figures["held_out_loss"] is None and any("held-out" in e for e in figures["errors"])

    one = _swarm(tmp_path, {
        "trainer-0": _trainer({ATTACKER: "3 disputes"}, {ATTACKER: 8}, {ATTACKER: 11}, [ATTACKER]),
        "trainer-1": _trainer({}, {}, {ATTACKER: 40}),
    })
    figures = bench_trust._figures(run, one, {"worker-s1-r1": ["noise:1"]}, 160)
    assert figures["samples_to_exclusion"] == {"worker-s1-r1": None}
    assert not figures["excluded_by_every_trainer"]
    assert figures["trainers"]["trainer-1"]["served_by_attackers"] == {ATTACKER[-8:]: 40}


def test_an_honest_worker_excluded_is_a_false_accusation_and_a_strike_is_counted(tmp_path, run):
    swarm = _swarm(tmp_path, {
        "trainer-0": _trainer({HONEST: "3 disputes"}, {HONEST: 30}, {HONEST: 80}, [HONEST]),
        "trainer-1": _trainer({}, {}, {HONEST: 80}, [HONEST]),
    })
    figures = bench_trust._figures(run, swarm, {"worker-s1-r1": ["noise:10"]}, 160)
    assert figures["false_accusations"] == [HONEST[-8:]] and figures["honest_strikes"] == 6


def test_the_table_takes_medians_over_runs_and_gaps_to_the_honest_baseline():
    runs = [{"attack": "scale:3", "checks": True, "samples_to_exclusion": {"w": n}, "held_out_loss": 2.2,
             "revoked_after_s": {"w": 30.0}} for n in (10, 30, 20)]
    runs.append({"attack": "scale:3", "checks": False, "samples_to_exclusion": {"w": None}, "held_out_loss": 2.4})
    table = bench_trust.summarize(runs, {"held_out_loss": 2.0})
    on, off = table["scale:3"]["on"], table["scale:3"]["off"]
    assert (on["samples_to_exclusion_median"], on["samples_to_exclusion_max"]) == (20, 30)
    assert on["held_out_gaps"] == [0.1, 0.1, 0.1] and on["revoked_after_s"] == [30.0] * 3
    assert off["never_excluded"] == 1 and off["samples_to_exclusion_median"] is None
    assert off["held_out_gaps"] == [0.2]


def test_signing_adds_a_few_hundred_bytes_a_sample(run):
    added = bench_trust.bytes_per_sample(run)
    # 64-byte signatures and an 8-byte fingerprint, with their msgpack keys and headers
    assert added["forward_reply"] > 72 and added["tail_backward_reply"] > 2 * 64 + 8
    assert 300 < added["per_sample"] < 800


def test_unknown_attacks_and_a_single_replica_are_refused():
    with pytest.raises(SystemExit):
        bench_trust.parse_args(["--attacks", "scale:3;teleport"])
    with pytest.raises(SystemExit):
        bench_trust.parse_args(["--workers-per-stage", "1"])
    assert bench_trust.parse_args(["--attacks", "noise:1,every:10;swap"]).attacks == ["noise:1,every:10", "swap"]


def test_the_model_is_the_mean_of_the_replicas_there_at_the_end():
    early, late = object(), object()
    replicas = [{0: "r0s0", 1: "r0s1"}, {0: "r1s0", 1: early}, {0: "r2s0", 1: late}]
    written = [{0: 150, 1: 150}, {0: 150, 1: 12}, {0: 150, 1: 150}]
    assert bench_trust._survivors(replicas, written) == [{0: "r0s0", 1: "r0s1"}, {0: "r1s0"}, {0: "r2s0", 1: late}]


def test_a_revoked_attacker_that_left_counts_everything_it_served():
    revocation = bench_trust.Revocation("http://127.0.0.1:1", {"worker-s1-r1"})
    revocation.left_at["worker-s1-r1"] = 40.0
    out = {"attacker_peer_ids": {"worker-s1-r1": "attacker"}, "samples_to_exclusion": {"worker-s1-r1": None},
           "trainers": {"trainer-0": {"served_before_exclusion": {"attacker": 9}, "served_by_attackers": {"attacker": 12}},
                        "trainer-1": {"served_before_exclusion": {}, "served_by_attackers": {"attacker": 15}}}}
    bench_trust._count_to_departure(out, revocation)
    assert out["samples_to_exclusion"] == {"worker-s1-r1": 24} and out["excluded_by_every_trainer"]


def test_the_mixed_variant_puts_replica_1_of_every_stage_in_bfloat16_and_keeps_the_other_arguments():
    admitted = lambda name: ["--account-token", f"account-{name}"]  # noqa: E731
    mixed = bench_trust._with_variant(admitted, "mixed")
    assert mixed("worker-s2-r1") == ["--account-token", "account-worker-s2-r1", "--compute-dtype", "bfloat16"]
    assert mixed("worker-s2-r0") == ["--account-token", "account-worker-s2-r0"]
    assert bench_trust._with_variant(None, "mixed")("worker-s0-r1") == ["--compute-dtype", "bfloat16"]
    assert bench_trust._with_variant(admitted, "plain") is admitted


def test_the_batch64_setting_runs_its_own_batch_and_steps():
    args = bench_trust.parse_args(["--setting", "batch64"])
    assert args.steps == 60
    assert bench_trust.trust_run_config(args, args.steps, checks=True).target_batch_size == 64
    assert bench_trust.parse_args([]).steps == 150


def test_overhead_pairs_divide_each_checks_on_run_by_the_checks_off_run_before_it():
    runs = [{"checks": True, "tokens_per_s": 1300.0}, {"checks": False, "tokens_per_s": 1000.0},
            {"checks": True, "tokens_per_s": 950.0}, {"checks": False, "tokens_per_s": 1200.0},
            {"checks": True, "tokens_per_s": None}, {"checks": False, "tokens_per_s": 800.0},
            {"checks": True, "tokens_per_s": 820.0}]
    assert bench_trust._pair_ratios(runs) == [0.95, 1.025]
    assert bench_trust.parse_args(["--overhead-pairs", "2"]).overhead_pairs == 2


def test_an_attack_on_sparseloco_runs_at_three_replicas_and_is_held_against_a_sparseloco_baseline():
    args = bench_trust.parse_args(["--attacks", "sloco_scale:100", "--steps", "20"])
    assert bench_trust.replicas_for(args, witnesses=True) == 3 and bench_trust.replicas_for(args, False) == 2
    run = bench_trust.trust_run_config(args, 20, checks=True, sparseloco=True)
    assert run.averaging.method == "sparseloco" and run.averaging.enabled
    assert bench_trust.trust_run_config(args, 20, checks=True).averaging.method == "asyncsparta"
    runs = [{"attack": "sloco_scale:100", "checks": True, "averaging": "sparseloco", "held_out_loss": 3.3,
             "samples_to_exclusion": {"w": 40}, "revoked_after_s": {"w": 12.0}},
            {"attack": "scale:3", "checks": True, "averaging": "asyncsparta", "held_out_loss": 2.2,
             "samples_to_exclusion": {"w": 10}}]
    table = bench_trust.summarize(runs, {"held_out_loss": 2.0}, {"held_out_loss": 3.0})
    assert table["sloco_scale:100"]["on"]["held_out_gaps"] == [0.1] and table["scale:3"]["on"]["held_out_gaps"] == [0.1]
    assert bench_trust.summarize(runs[:1], {"held_out_loss": 2.0})["sloco_scale:100"]["on"]["held_out_gaps"] == []


def test_an_attack_on_asyncsparta_runs_at_three_replicas_and_compares_only_with_its_own_order():
    args = bench_trust.parse_args(["--attacks", "spart_scale:100", "--steps", "20"])
    run = bench_trust.trust_run_config(args, 20, checks=True, witnesses=True)
    assert run.averaging.method == "asyncsparta" and run.averaging.enabled
    assert bench_trust.replicas_for(args, witnesses="spart_scale:100" in bench_trust.AVERAGING_ATTACKS) == 3
    runs = [{"attack": "spart_scale:100", "checks": True, "averaging": "asyncsparta", "workers_per_stage": 3,
             "held_out_loss": 2.2, "samples_to_exclusion": {}, "revoked_after_s": {"w": 3.0}}]
    table = bench_trust.summarize(runs, {"held_out_loss": 2.0, "workers_per_stage": 2})
    assert table["spart_scale:100"]["on"]["held_out_gaps"] == []  # two replicas against three: no gap


def test_the_honest_variants_can_be_chosen():
    assert bench_trust.parse_args([]).honest_variants == ["churn", "workers", "mixed", "skipping", "sparseloco",
                                                           "early_departure"]
    assert bench_trust.parse_args(["--honest-variants", "plain,early_departure"]).honest_variants == [
        "plain", "early_departure"]
    assert bench_trust.parse_args(["--honest-variants", "sparseloco"]).honest_variants == ["sparseloco"]
    with pytest.raises(SystemExit):
        bench_trust.parse_args(["--honest-variants", "tidy"])


def _reference_swarm(tmp_path, run, trainers: dict) -> dict:
    """A swarm that trained exactly like the one-process reference, 3 steps of 4 samples, with its
    sample logs and final checkpoints; replica 1 of stage 1 left after step 1 (an early checkpoint)
    and a last step was logged that no stage applied."""
    import json

    from _fidelity_reference import OneProcessTrainer, SampleBank
    from roles.worker.layout import FlatLayout
    from roles.worker.state.stage_checkpoint import checkpoint_path, write_checkpoint

    bank, trainer = SampleBank(run), OneProcessTrainer.for_stages(run)
    logs = [str(tmp_path / f"samples-{k}.jsonl") for k in range(2)]
    directories = [tmp_path / "r0", tmp_path / "r1"]

    def checkpoint(directory, stages, step: int) -> None:
        for stage in stages:
            names = FlatLayout.of_module(stage).names
            write_checkpoint(checkpoint_path(directory, run.run_id, stage.stage_index),
                             {n: p.detach().clone() for n, p in zip(names, stage.trainable_parameters())},
                             {"step": str(step)})

    steps = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 10, 11], [12, 13]]  # sample 9 dropped; the last step unapplied
    with open(logs[0], "w") as a, open(logs[1], "w") as b:
        for number, indices in enumerate(steps):
            if number < 3:
                trainer.step(bank.tokens(indices))
            if number == 0:
                checkpoint(directories[1], trainer.model.stages[1:2], 1)
            for index in indices:
                (a if index % 2 == 0 else b).write(json.dumps({
                    "sample_id": f"s{index % 2}-{index}", "step": number, "loss": 2.0}) + "\n")
    checkpoint(directories[0], trainer.model.stages, 3)
    checkpoint(directories[1], [trainer.model.stages[0], trainer.model.stages[2]], 3)
    return {**_swarm(tmp_path, trainers), "sample_logs": logs}


def test_a_run_that_trained_like_its_own_order_reference_has_no_gap_to_it(monkeypatch, tmp_path, run):
    import bench_fidelity

    monkeypatch.setattr(bench_fidelity, "HELD_OUT_SAMPLES", 16)  # the held-out evaluations dominate the time
    honest_dispute = {"stage": 1, "worker": HONEST, "checker": ATTACKER, "kind": "output", "struck": HONEST,
                      "arbiter": None, "self_contradiction": False, "sign_test": [9, 10]}
    trainers = {"trainer-0": _trainer({ATTACKER: "3 disputes"}, {ATTACKER: 5}, {ATTACKER: 6, HONEST: 7}, [ATTACKER]),
                "trainer-1": _trainer({ATTACKER: "3 disputes"}, {ATTACKER: 3}, {ATTACKER: 4, HONEST: 9}, [ATTACKER])}
    checks = trainers["trainer-1"]["spot_checks"]
    checks["strikes"][HONEST] = 2
    checks["disputes"] = [*checks["disputes"], honest_dispute,
                          {**honest_dispute, "kind": "gradient", "sign_test": None}]
    checks["strikes_by_mechanism"][HONEST] = {"tally": 1, "slope": 1}
    figures = bench_trust._figures(run, _reference_swarm(tmp_path, run, trainers), {"worker-s1-r1": ["noise:1"]}, 12)
    own = figures["own_order_reference"]
    assert (own["steps"], own["samples"], own["applied_step"], own["samples_in_unapplied_steps"]) == (3, 11, 3, 2)
    assert figures["held_out_loss"] == pytest.approx(figures["own_order_reference_held_out_loss"], abs=2e-4)
    assert figures["gap_to_own_order"] == pytest.approx(0.0, abs=2e-4)
    assert not [e for e in figures["errors"] if "own-order" in e or "held-out" in e]
    # who struck the honest worker, and how; each trainer's spot_checks as reported
    assert figures["honest_strikes"] == 2
    assert figures["honest_strikes_by_mechanism"] == {"slope": 1, "tally": 1}
    assert figures["honest_workers_struck"] == {"worker-s1-r0": 2}
    assert figures["trainers"]["trainer-1"]["spot_checks"]["strikes"][HONEST] == 2

    table = bench_trust.summarize([{"attack": "noise:1", "checks": True, **figures}], {"held_out_loss": 2.0})
    row = table["noise:1"]["on"]
    assert row["own_order_gaps"] == [figures["gap_to_own_order"]]
    assert row["own_order_gap_median"] == row["own_order_gap_max"] == figures["gap_to_own_order"]
    assert row["honest_strikes_by_mechanism"] == {"slope": 1, "tally": 1}


def test_the_honest_floor_is_the_honest_runs_gaps_to_their_own_order():
    honest = [{"variant": "plain", "checks": True, "gap_to_own_order": 0.001},
              {"variant": "early_departure", "checks": True, "gap_to_own_order": -0.004},
              {"variant": "plain", "checks": False, "gap_to_own_order": 0.02},
              {"variant": "churn", "checks": True, "gap_to_own_order": None}]
    floor = bench_trust.honest_floor(honest)
    assert floor["by_variant"] == {"plain": [0.001], "early_departure": [-0.004], "plain (checks off)": [0.02]}
    assert (floor["own_order_gap_max"], floor["own_order_gap_max_abs"]) == (0.001, 0.004)
    assert bench_trust.relative_gap(2.02, 2.0) == 0.01 and bench_trust.relative_gap(None, 2.0) is None



def test_every_run_can_route_worker_to_worker():
    args = bench_trust.parse_args(["--routing", "workers", "--steps", "10"])
    assert args.routing == "workers" and bench_trust.parse_args([]).routing == "trainer"
    assert bench_trust.trust_run_config(args, 10, checks=True, routing=args.routing).routing.path == "workers"
    with pytest.raises(SystemExit):
        bench_trust.parse_args(["--routing", "relay"])
