"""AsyncSPARTA and sync phases in real swarms on 127.0.0.1, driven through the CLI [report 4.2,
3.3.1.1, 3.3.1.8, 5.7]: replicas converge, killed senders and reducers give partial rounds that
are reported (with the right slice) and later rounds recover, a joiner passes its sync phases,
and two replicas per stage train with averaging on.

Rounds are observed through the workers' `{run}/stage/{s}/averaging` and `.../workers` DHT
records (read by a probe DHT client), their logs and their exit summaries; weights through the
checkpoints the workers write when they exit.
"""

from __future__ import annotations

import os
import signal
import time

import hivemind
import pytest
import torch
from hivemind.utils import get_dht_time
from pydantic import ValidationError
from safetensors.torch import load_file

from protocol.dht_schema import AveragingRecord, RoundStatus, WorkerRecord, averaging_key, schema_for_run, workers_key
from protocol.records import SignedRecordValidator
from protocol.run_config import load_run_config
from roles.model.stage import StageModel
from tests.support.faults_node import faults_prefix
from tests.support.metrics import metric_value, scrape
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

TWO_STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]
FAST_ROUNDS = {"average_every": 2, "segments": 4, "matchmaking_time_s": 1.5, "request_timeout_s": 0.7,
               "sender_timeout_s": 2.0, "allreduce_timeout_s": 20.0, "part_size_bytes": 4096}
IDLE_ROUNDS = {**FAST_ROUNDS, "idle_period_s": 3.0}
PATIENT_ROUNDS = {**IDLE_ROUNDS, "sender_timeout_s": 8.0}
"""For the exact-mean check: a reducer whose slice comes back late (two test files share two cores)
leaves that slice averaged on some replicas and local on another, which moves the mean for good."""
COMMON = ["--announce-period-s", "1"]


class DhtProbe:
    """A client-mode DHT node in the test process that reads the swarm's signed records."""

    def __init__(self, maddrs: list[str], run_id: str, num_stages: int):
        validator = SignedRecordValidator(None, schema_for_run(run_id, num_stages), run_id=run_id)
        self.dht = hivemind.DHT(initial_peers=maddrs, client_mode=True, start=True, record_validators=[validator])

    def records(self, key: str, model):
        found = self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        records, now = {}, get_dht_time()
        for subkey, item in found.value.items():
            value = item.value
            if item.expiration_time < now or (isinstance(value, dict) and value.get("tombstone")):
                continue
            try:
                records[subkey] = model.model_validate(value)
            except ValidationError:
                continue
        return records

    def close(self):
        self.dht.shutdown()


def log_has(node, text: str) -> bool:
    try:
        with open(node.log_path, errors="replace") as f:
            return text in f.read()
    except OSError:
        return False


def load_weights(directory: str) -> dict[str, torch.Tensor]:
    [name] = [n for n in os.listdir(directory) if n.endswith(".safetensors")]
    return load_file(os.path.join(directory, name))


def flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([weights[k].reshape(-1) for k in sorted(weights)])


def rounds_of(probe: DhtProbe, run_id: str, stage: int) -> dict[str, AveragingRecord]:
    return probe.records(averaging_key(run_id, stage), AveragingRecord)


def _rounds_that_move_the_mean(summary: dict) -> list[dict]:
    """Rounds after which the replicas' mean is no longer the mean they started from: a slice that
    fell back to local values on one replica, a banned sender, or a round that failed on one
    replica after its group formed (the others may have averaged its values). A round that ran
    with fewer peers than the stage has, or formed no group, keeps the mean (equal weights)."""
    return [r for r in summary["averaging"]["rounds"]
            if r.get("failed_slices") or r.get("banned_senders") or (r["status"] == "failed" and r["group_size"] > 1)]


def _one_pass_of_three_replicas(make_swarm, config, run, tmp_path, attempt: int):
    """Three reducers from three seeds average on the idle clock until every segment had a
    complete round of all three with weight 1; their initial and final weights and what moved the mean."""
    swarm = make_swarm(config, common_args=COMMON)
    dirs = [str(tmp_path / f"attempt{attempt}" / f"ckpt{i}") for i in range(3)]
    workers = [swarm.start("worker", stage=0, wait_ready=i == 0,
                           args=["--reducer", "--checkpoint-dir", dirs[i], "--checkpoint-period-s", "3600"],
                           prefix=faults_prefix(init_seed_offset=i + 1)) for i in range(3)]
    for worker in workers[1:]:
        swarm.wait_ready(worker)
    probe = DhtProbe(workers[0].maddrs, run.run_id, run.num_stages)
    try:
        def full_pass_done():
            records = rounds_of(probe, run.run_id, 0)
            if len(records) < 3:
                return False
            done = []
            for record in records.values():
                segments = {r.segment for r in record.recent if r.status == RoundStatus.COMPLETE and r.group_size == 3
                            and r.weight == 1.0}
                done.append(segments == set(range(4)))
            return all(done)

        poll_until(full_pass_done, 90, "a complete round of all three replicas on every segment", period_s=0.3)
    finally:
        probe.close()
    disturbed = []
    for worker in workers:
        assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
        disturbed += _rounds_that_move_the_mean(worker.summary())
    swarm.stop_all()
    return [flat(load_weights(d)) for d in dirs], disturbed


@pytest.mark.timeout(420)
def test_replicas_from_different_weights_agree_after_one_pass(make_swarm, run_config_path, tmp_path):
    """Three reducers, no training, rounds on the idle clock: within 1e-4 after every segment
    was averaged once by all three with weight 1, and at the plain mean of their starting weights
    when no round lost a slice. On a loaded machine a reducer's slice can come back after its
    timeout and stay local on one replica, which moves the mean for good; such a run is reported
    by the replicas themselves and played again (three tries)."""
    config = run_config_path(stages=TWO_STAGES, averaging=PATIENT_ROUNDS)
    run = load_run_config(config)
    initial = [flat(StageModel(run.model_copy(update={"seed": i + 1}), 0).state_dict()) for i in range(3)]
    assert (initial[0] - initial[1]).abs().max() > 1e-2, "the replicas must start apart"
    mean = torch.stack(initial).mean(0)
    for attempt in range(3):
        final, disturbed = _one_pass_of_three_replicas(make_swarm, config, run, tmp_path, attempt)
        spread = max(float((final[0] - other).abs().max()) for other in final[1:])
        print(f"attempt {attempt}: replica spread after one pass {spread:.2e} "
              f"(started {float((initial[0] - initial[1]).abs().max()):.2e}); rounds that moved the mean: {disturbed}")
        assert spread < 1e-4
        if not disturbed:
            assert float((final[0] - mean).abs().max()) < 1e-4, "weight 1 each: the plain mean of the three"
            return
    pytest.fail(f"every try had a round that lost a slice or failed on one replica; the last: {disturbed}")


def _kill_mid_round(make_swarm, run_config_path, *, victim_reduces: bool):
    config = run_config_path(stages=TWO_STAGES, averaging=IDLE_ROUNDS)
    run = load_run_config(config)
    swarm = make_swarm(config, common_args=COMMON)
    survivors = [swarm.start("worker", stage=0, args=["--reducer"], wait_ready=i == 0) for i in range(2)]
    swarm.wait_ready(survivors[1])
    victim = swarm.start("worker", stage=0, args=["--reducer"] if victim_reduces else [],
                         prefix=faults_prefix(averaging_stall_s=60))
    poll_until(lambda: log_has(victim, "test fault: stalling"), 60, "the victim to stall mid-round", period_s=0.3)
    with open(victim.log_path) as f:
        stalled = next(line for line in f if "test fault: stalling" in line)
    stalled_round = int(stalled.split(" round ")[1].split()[0])
    swarm.stop(victim, signal.SIGKILL)
    probe = DhtProbe(survivors[0].maddrs, run.run_id, run.num_stages)
    try:
        def outcome_of(round_id, peers, repair=False):
            found = {}
            for peer, record in rounds_of(probe, run.run_id, 0).items():
                for summary in record.recent:
                    if summary.round == round_id and (summary.kind == "repair") == repair:
                        found[peer] = summary
            return found if set(found) >= set(peers) else None

        def what_survivors_saw(what):
            lines = [f"timed out waiting for {what}; round {stalled_round} as the survivors logged it:"]
            for survivor in survivors:
                with open(survivor.log_path, encoding="utf-8", errors="replace") as f:
                    lines += [f"  {survivor.peer_id[-6:]}: {line.rstrip()}" for line in f
                              if f"round {stalled_round}" in line]
            return "\n".join(lines)

        killed = poll_until(lambda: outcome_of(stalled_round, [s.peer_id for s in survivors]), 40,
                            "the survivors' report of the stalled round", period_s=0.3)
        repaired = None
        if victim_reduces:
            # On a loaded machine matchmaking may split the stage: only the survivors grouped with
            # the victim lost its slice, and a repair needs two of them.
            grouped = [peer for peer, summary in killed.items()
                       if any(failed.reducer == victim.peer_id for failed in summary.failed_slices)]
            repaired = {}
            if len(grouped) >= 2:
                try:
                    repaired = poll_until(lambda: outcome_of(stalled_round, grouped, repair=True), 40,
                                          "the survivors' repair of the stalled round", period_s=0.3)
                except AssertionError:
                    raise AssertionError(what_survivors_saw("the survivors' repair")) from None
            else:
                print(f"the stage split in round {stalled_round}: {len(grouped)} survivor(s) lost the victim's "
                      f"slice, so there was no repair to check")

        def later_complete():
            for record in rounds_of(probe, run.run_id, 0).values():
                for summary in record.recent:
                    if summary.round > stalled_round and summary.status == RoundStatus.COMPLETE:
                        return summary
            return None

        recovered = poll_until(later_complete, 40, "a complete round after the kill", period_s=0.3)
    finally:
        probe.close()
    for survivor in survivors:
        assert survivor.proc.poll() is None, "a survivor died:\n" + survivor.log_tail()
    return victim, killed, recovered, repaired


@pytest.mark.timeout(150)
def test_a_sender_killed_mid_round_gives_a_partial_round_then_complete_ones(make_swarm, run_config_path):
    victim, killed, recovered, _ = _kill_mid_round(make_swarm, run_config_path, victim_reduces=False)
    # On a loaded machine matchmaking may split the stage; the survivors the victim was grouped
    # with are the ones that banned it.
    with_victim = [s for s in killed.values() if victim.peer_id in s.banned_senders]
    assert with_victim, killed
    for summary in with_victim:
        assert summary.status == RoundStatus.PARTIAL, summary
        assert summary.averaging_success == 1.0, "a sender's death leaves every slice reduced"
        assert summary.reduce_success is not None and summary.reduce_success < 1.0
    assert all(s.status != RoundStatus.COMPLETE for s in killed.values()), killed
    print(f"killed round: {[s.failure_reason for s in killed.values()]}; recovered: round {recovered.round} "
          f"group {recovered.group_size}/{recovered.expected_group_size}")
    assert recovered.group_size == 2 and recovered.expected_group_size == 2


@pytest.mark.timeout(150)
def test_a_reducer_killed_mid_round_reports_its_slice_then_rounds_recover(make_swarm, run_config_path):
    """The dead reducer's slice stays local on every survivor; they repair it at once (the same
    segment averaged again among the two of them), so the round's slice is averaged after all."""
    victim, killed, recovered, repaired = _kill_mid_round(make_swarm, run_config_path, victim_reduces=True)
    with_victim = [s for s in killed.values() if s.failed_slices]
    assert with_victim, killed
    slices = set()
    for summary in with_victim:
        assert summary.status == RoundStatus.PARTIAL, summary
        # The dead reducer's slice falls back. On a loaded machine a survivor's slice may time out
        # too (it waits out the dead sender before it answers), so others may be listed as well.
        [failed] = [f for f in summary.failed_slices if f.reducer == victim.peer_id]
        assert 0 < failed.failed_elements <= failed.end - failed.start
        assert summary.averaging_success < 1.0
        slices.add((failed.start, failed.end))
    assert len(slices) == 1, "every survivor names the same slice for the dead reducer"
    assert all(s.status != RoundStatus.COMPLETE for s in killed.values()), killed
    for summary in repaired.values():
        assert summary.status == RoundStatus.COMPLETE and summary.averaging_success == 1.0, summary
        assert summary.group_size == 2 and summary.expected_group_size == 2, summary
    print(f"killed round: {[s.failure_reason for s in killed.values()]}; repaired: "
          f"{[(s.status.value, s.averaging_success) for s in repaired.values()]}; recovered: round {recovered.round}")


@pytest.mark.timeout(200)
def test_a_joiner_passes_weight_sync_then_optimizer_sync_then_becomes_active(make_swarm, run_config_path, tmp_path):
    config = run_config_path(stages=TWO_STAGES, target_batch_size=8, averaging=FAST_ROUNDS,
                             sync={"max_stale_steps": 2, "weight_sync_steps": 16, "optimizer_sync_steps": 12})
    run = load_run_config(config)
    swarm = make_swarm(config, common_args=COMMON)
    checkpoints = str(tmp_path / "checkpoints")
    first = swarm.start("worker", stage=0, args=["--reducer", "--checkpoint-dir", checkpoints,
                                                 "--checkpoint-period-s", "3600"])
    tail = swarm.start("worker", stage=1, wait_ready=False)
    trainer = swarm.start("trainer", wait_ready=False,
                          args=["--lanes", "2", "--discovery-period-s", "1", "--request-timeout-s", "10"])
    swarm.wait_ready(tail)
    swarm.wait_ready(trainer)
    probe = DhtProbe(first.maddrs, run.run_id, run.num_stages)
    seen: list[str] = []
    try:
        poll_until(lambda: log_has(tail, "stage 1 step 6"), 90, "the stage to train past max_stale_steps", period_s=0.3)
        joiner = swarm.start("worker", stage=0, wait_ready=False,
                             args=["--state-source", "checkpoint", "--checkpoint-dir", checkpoints])
        poll_until(joiner.ready.is_set, 90, "the joiner to start")

        def phases():
            record = probe.records(workers_key(run.run_id, 0), WorkerRecord).get(joiner.peer_id)
            if record is not None and (not seen or seen[-1] != record.phase.value):
                seen.append(record.phase.value)
            return seen and seen[-1] == "active"

        poll_until(phases, 120, "the joiner to become active", period_s=0.1)
    finally:
        probe.close()
    assert seen == ["weight_sync", "optimizer_sync", "active"], seen
    assert swarm.stop(trainer, signal.SIGTERM) == 0
    assert swarm.stop(joiner, signal.SIGTERM) == 0, joiner.log_tail()
    summary = joiner.summary()
    assert summary["joined"]["loaded_step"] == 0 and summary["joined"]["phase"] == "weight_sync"
    assert summary["joined"]["source"].startswith("checkpoint")
    weight_sync, optimizer_sync, active = summary["sync_phases"]
    assert (weight_sync["forward_requests"], weight_sync["backward_requests"]) == (0, 0), \
        "no trainer request reached the worker in weight sync"
    assert optimizer_sync["backward_requests"] > 0, "in optimizer sync it serves batches"
    assert optimizer_sync["to_step"] - optimizer_sync["from_step"] >= 12
    # no trainer request and no replica's gradients were turned away (a tag ask from a replica the
    # joiner has not read yet is refused, and the asker reads the stage's records again: not counted).
    # Right after joining, the joiner's open step trails the stage by the steps taken since it read
    # the stage's progress; a replica's contribution more than two steps ahead of it is refused then
    # (the replica steps on without it, the joiner catches up): counted apart, as refused_ahead.
    refused = {call: n for call, n in summary["rejected_calls"].items() if "tags" not in call}
    ahead = (summary.get("gradient_exchange") or {}).get("refused_ahead", 0)
    if ahead and refused.get("agora/v1/step_gradients invalid_request", 0) <= ahead:
        refused.pop("agora/v1/step_gradients invalid_request")
    assert refused == {}, (summary["requests"], summary["rejected_calls"], joiner.log_tail())
    weights = {r["weight"] for r in summary["averaging"]["rounds"] if r["status"] != "skipped"}
    print(f"joiner phases {seen}; round weights seen {sorted(weights)}; spans {summary['sync_phases']}")


@pytest.mark.timeout(200)
def test_a_joiner_whose_stage_lost_every_active_replica_carries_it_on(make_swarm, run_config_path):
    """The only active replica of stage 0 dies while a joiner is in weight sync: with nobody left
    to sync with, the joiner becomes active within `sync.alone_exit_s` after the dead replica's
    record lapses, and the trainer completes samples through it (before, the stage stood still)."""
    config = run_config_path(stages=TWO_STAGES, target_batch_size=4,
                             sync={"max_stale_steps": 1, "weight_sync_steps": 10_000, "alone_exit_s": 3.0})
    swarm = make_swarm(config, common_args=COMMON)
    first = swarm.start("worker", stage=0)
    tail = swarm.start("worker", stage=1, wait_ready=False)
    swarm.wait_ready(tail)
    trainer = swarm.start("trainer", args=["--lanes", "2", "--discovery-period-s", "1", "--request-timeout-s", "5"])
    poll_until(lambda: log_has(first, "stage 0 step 3:"), 90, "stage 0 to step past max_stale_steps", period_s=0.3)
    joiner = swarm.start("worker", stage=0, args=["--state-source", "none"])
    assert log_has(joiner, "joined stage 0 in weight_sync"), joiner.log_tail()
    swarm.stop(first, signal.SIGKILL)
    poll_until(lambda: log_has(joiner, "sync phase weight_sync -> active"), 60,
               "the joiner to become active once no active replica is left", period_s=0.3)

    def stepped_after_going_active():
        with open(joiner.log_path, errors="replace") as f:
            return "stage 0 step" in f.read().split("sync phase weight_sync -> active", 1)[-1]

    poll_until(stepped_after_going_active, 60, "the stage to step on the joiner", period_s=0.3)
    assert swarm.stop(trainer, signal.SIGTERM) == 0, trainer.log_tail()
    assert swarm.stop(joiner, signal.SIGTERM) == 0, joiner.log_tail()
    summary = joiner.summary()
    weight_sync, active = summary["sync_phases"]
    assert weight_sync["phase"] == "weight_sync" and active["phase"] == "active"
    assert "no active replica of the stage" in active["reason"], active
    assert summary["counters"]["backward_requests"] > 0, "the trainer routed samples through it"
    assert summary["local_step"] > active["from_step"], "the stage stepped again"


@pytest.mark.timeout(200)
def test_two_replicas_per_stage_train_with_averaging(make_swarm, run_config_path, tmp_path):
    """Loss falls, and each stage's two replicas stay far closer to each other than to where they
    started: with averaging about 0.1-0.2x of the distance each moved; a comparable run without
    averaging ended at 0.35x (stage 0) and 0.22x (stage 1)."""
    # Rounds every 3 steps of 16 samples: seconds apart, longer than a round takes (a round that
    # overruns the interval makes replicas skip different rounds).
    config = run_config_path(stages=TWO_STAGES, target_batch_size=16, averaging={**FAST_ROUNDS, "average_every": 3})
    run = load_run_config(config)
    swarm = make_swarm(config, common_args=COMMON)
    dirs, workers = {}, []
    for stage in (0, 1):
        for i, reducer in enumerate((True, False)):
            dirs[(stage, i)] = str(tmp_path / f"s{stage}r{i}")
            args = ["--checkpoint-dir", dirs[(stage, i)], "--checkpoint-period-s", "3600", "--metrics-port", "0"]
            args += ["--reducer"] if reducer else []
            workers.append(swarm.start("worker", stage=stage, args=args, wait_ready=not workers))
    for worker in workers[1:]:
        swarm.wait_ready(worker)
    trainer = swarm.start("trainer", args=["--lanes", "4", "--max-samples", "640", "--discovery-period-s", "1"])
    assert swarm.wait(trainer, 150) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_completed"] >= 600, summary
    assert summary["last_loss"] < summary["first_loss"] * 0.85, summary
    for worker in workers:  # the rounds show in the worker's metrics: outcome, duration, completeness, bytes
        families = scrape(worker)
        done = sum(metric_value(families, "agora_averaging_rounds", "_total", outcome=o) for o in ("complete", "partial"))
        assert done >= 3, worker.name
        assert metric_value(families, "agora_averaging_round_seconds", "_count") >= done, worker.name
        assert metric_value(families, "agora_averaging_round_seconds", "_sum") > 0, worker.name
        # the last round's share: 0 when that round failed (CI saw a last round fail under load)
        assert 0 <= metric_value(families, "agora_averaging_completeness_ratio") <= 1, worker.name
        assert metric_value(families, "agora_bytes_sent", "_total", channel="averaging") > 0, worker.name
        assert metric_value(families, "agora_bytes_received", "_total", channel="averaging") > 0, worker.name
    for worker in workers:
        assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
    lines = [f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}"]
    for stage in (0, 1):
        replicas = [load_weights(dirs[(stage, i)]) for i in (0, 1)]
        start = StageModel(run, stage).state_dict()
        initial = flat({name: start[name] for name in replicas[0]})
        a, b = (flat(weights) for weights in replicas)
        distance = float((a - b).norm() / a.norm())
        movement = min(float((x - initial).norm() / initial.norm()) for x in (a, b))
        counters = [w.summary()["averaging"]["counters"] for w in workers if w.stage == stage]
        lines.append(f"stage {stage}: replica distance {distance:.3e} (relative L2), each moved >= {movement:.3e} "
                     f"from init; rounds {counters}")
        assert all(c.get("rounds_complete", 0) + c.get("rounds_partial", 0) >= 3 for c in counters), counters
        assert distance < 0.5 * movement, lines[-1]
    print("\n".join(lines))


@pytest.mark.timeout(150)
def test_a_worker_with_another_index_set_is_reported_and_leaves_its_stage(make_swarm, run_config_path):
    """A replica whose index sets differ (here: another `segments`) never meets the others; they
    report it, and since the stage keeps averaging without it, it fails 2 of its last 3 rounds and
    leaves with exit code 3 [report 3.3.1.6]."""
    # The rule applies where replicas do not add up their gradients every step (with them, a
    # missed round costs no agreement and the worker only warns).
    rounds_only = {**IDLE_ROUNDS, "gradients": "off"}
    config = run_config_path(stages=TWO_STAGES, averaging=rounds_only)
    run = load_run_config(config)
    other = run_config_path(run_id=run.run_id + "x", stages=TWO_STAGES,
                            averaging={**rounds_only, "segments": 5})
    outsider_config = os.path.join(os.path.dirname(other), "outsider.yaml")
    with open(other) as src, open(outsider_config, "w") as dst:
        dst.write(src.read().replace(f"run_id: {run.run_id}x", f"run_id: {run.run_id}"))
    swarm = make_swarm(config, common_args=COMMON)
    good = [swarm.start("worker", stage=0, args=["--reducer"], wait_ready=i == 0) for i in range(2)]
    swarm.wait_ready(good[1])
    outsider = swarm.start("worker", stage=0, args=["--reducer", "--config", outsider_config])
    assert swarm.wait(outsider, 90) == 3, outsider.log_tail()
    exited_at = time.monotonic()
    assert log_has(outsider, "leaving stage 0") and log_has(outsider, "the limit is 2 of 3")
    assert log_has(outsider, "self-termination rule averaging: the worker failed too many of its recent averaging")
    terminated = poll_until(outsider.summary, 5, "the outsider's summary")["terminated_by"]
    assert terminated["rule"] == "averaging" and terminated["exit_code"] == 3, terminated
    assert not log_has(outsider, "node: worker failed"), "a rule exit is no bug: " + outsider.log_tail(60)
    probe = DhtProbe(good[0].maddrs, run.run_id, run.num_stages)
    try:
        # Withdrawn as it left; on a loaded machine the tombstone's store can time out, and the
        # record then lapses by itself within its TTL (three announce periods: 3 s here). 10 s was
        # once too little beside other tests (a clean-clone CI run), so the lookups are timed and
        # listed if this fails: slow lookups, or a record that outlives its TTL (a real bug).
        lookups = []

        def outsider_gone() -> bool:
            started = time.monotonic()
            present = outsider.peer_id in probe.records(workers_key(run.run_id, 0), WorkerRecord)
            lookups.append(f"{started - exited_at:.1f}s after the exit: {'present' if present else 'gone'} "
                           f"({time.monotonic() - started:.1f}s lookup)")
            return not present

        try:
            poll_until(outsider_gone, 30, "the outsider's record withdrawn or lapsed", period_s=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; lookups: {lookups}") from None
        reported = poll_until(lambda: [s for r in rounds_of(probe, run.run_id, 0).values() for s in r.recent
                                       if outsider.peer_id in s.mismatched_peers], 20,
                              "a round that names the outsider's index set", period_s=0.5)
    finally:
        probe.close()
    assert reported[0].status in (RoundStatus.COMPLETE, RoundStatus.PARTIAL)
    for worker in good:
        assert worker.proc.poll() is None, worker.log_tail()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("poison, why", [("nan", "not finite"), ("huge", "norm")])
def test_a_replica_sending_garbage_is_left_out_and_the_round_completes_for_the_others(
        make_swarm, run_config_path, tmp_path, poison, why):
    """Two honest reducers and a sender whose parts are NaN (or a million times too large): each
    reducer leaves the poisoner out of its slice's average, the round completes for the honest two
    (partial, naming the poisoner), and their weights stay finite."""
    config = run_config_path(stages=TWO_STAGES, averaging=IDLE_ROUNDS)
    run = load_run_config(config)
    swarm = make_swarm(config, common_args=COMMON)
    dirs = [str(tmp_path / f"ckpt{i}") for i in range(2)]
    honest = [swarm.start("worker", stage=0, wait_ready=i == 0,
                          args=["--reducer", "--checkpoint-dir", dirs[i], "--checkpoint-period-s", "3600"])
              for i in range(2)]
    swarm.wait_ready(honest[1])
    poisoner = swarm.start("worker", stage=0, prefix=faults_prefix(averaging_poison=poison))
    probe = DhtProbe(honest[0].maddrs, run.run_id, run.num_stages)
    try:
        def poisoned_rounds():
            found = {}
            for peer, record in rounds_of(probe, run.run_id, 0).items():
                for summary in record.recent:
                    if peer in {w.peer_id for w in honest} and poisoner.peer_id in summary.banned_senders:
                        found[peer] = summary
            return found if len(found) == 2 else None

        reports = poll_until(poisoned_rounds, 80, "both honest reducers to report a round without the poisoner",
                             period_s=0.3)
    finally:
        probe.close()
    for summary in reports.values():
        assert summary.status == RoundStatus.PARTIAL, summary
        assert summary.group_size == 3 and summary.averaging_success == 1.0, summary
        assert "rejected sender(s)" in summary.failure_reason and why in summary.failure_reason, summary
        assert summary.relative_distance is not None and summary.relative_distance < 10, summary
    for worker in honest:
        assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
    for worker, directory in zip(honest, dirs):
        averaging = worker.summary()["averaging"]
        assert averaging["counters"].get("senders_rejected", 0) >= 1, averaging["counters"]
        rejected = [r["rejected_senders"] for r in averaging["rounds"] if r.get("rejected_senders")]
        assert rejected and all(set(r) == {poisoner.peer_id} and why in r[poisoner.peer_id] for r in rejected)
        weights = flat(load_weights(directory))
        assert torch.isfinite(weights).all() and float(weights.abs().max()) < 100, "the garbage never got in"
    print(f"{poison}: {[s.failure_reason for s in reports.values()]}")


@pytest.mark.timeout(240)
def test_a_stage_started_without_reducers_elects_one_and_elects_again_when_it_dies(make_swarm, run_config_path):
    """Three workers of a stage, none with --reducer (before: every round skipped, "no reducer in
    the stage"): the stage elects one, the longest-running, which promotes itself and the rounds
    complete with all three. SIGKILL the elected one: the two left elect the other of them and
    keep averaging."""
    config = run_config_path(stages=TWO_STAGES, averaging=IDLE_ROUNDS)
    run = load_run_config(config)
    swarm = make_swarm(config, common_args=COMMON)
    workers = [swarm.start("worker", stage=0, wait_ready=i == 0) for i in range(3)]
    for worker in workers[1:]:
        swarm.wait_ready(worker)
    probe = DhtProbe(workers[0].maddrs, run.run_id, run.num_stages)

    def completed_with(size: int, exclude: frozenset = frozenset()):
        records = {p: r for p, r in rounds_of(probe, run.run_id, 0).items() if p not in exclude}
        elected = [p for p, r in records.items() if r.elected and r.reducer]
        complete = [p for p, r in records.items()
                    if any(s.status == RoundStatus.COMPLETE and s.group_size == size for s in r.recent)]
        return elected if len(records) == size and len(complete) == size and elected else None

    try:
        [first] = poll_until(lambda: completed_with(3), 90, "a complete round of all three with an elected reducer",
                             period_s=0.3)
        victim = next(w for w in workers if w.peer_id == first)
        assert log_has(victim, "this worker was elected"), victim.log_tail()
        swarm.stop(victim, signal.SIGKILL)
        [second] = poll_until(lambda: completed_with(2, frozenset({first})), 90,
                              "the two left to elect another reducer and complete a round", period_s=0.3)
        assert second != first
    finally:
        probe.close()
    for worker in workers:
        if worker is not victim:
            assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
            summary = worker.summary()["averaging"]
            assert summary["elected"] == (worker.peer_id == second), summary
            assert not [r for r in summary["rounds"] if "no reducer" in r["failure_reason"]], summary["rounds"]


@pytest.mark.timeout(330)
def test_a_replica_far_from_the_others_is_reported_and_rejoins_through_weight_sync(make_swarm, run_config_path):
    """Three replicas on the idle clock, two from the run's seed and one from another seed: the
    odd one sits about twice as far from each round's average as the others (1.3 vs 0.6,
    relative L2), is judged the outlier two rounds in a row, goes back to weight sync (weight 0)
    and leaves it once a full pass of complete rounds replaced its weights; its last rounds then
    sit at the average."""
    # Judging takes rounds of all three: matchmaking with room for a loaded machine (a CI run beside
    # the full suite formed too few of them within 120 s with 1.5 s and 0.7 s, every 3 s). Each
    # round averages one segment in full, so a segment a round of two already pulled in no longer
    # shows the odd replica: with 4 segments, two such rounds under load left no two fresh ones in
    # a row (outlier, not, outlier) and the pass brought it in without a resync; 8 leave room.
    config = run_config_path(stages=TWO_STAGES, sync={"optimizer_sync_steps": 0},
                             averaging={**IDLE_ROUNDS, "idle_period_s": 4.0, "matchmaking_time_s": 2.0,
                                        "request_timeout_s": 1.5, "segments": 8})
    swarm = make_swarm(config, common_args=COMMON)
    workers = [swarm.start("worker", stage=0, args=["--reducer"], wait_ready=i == 0,
                           prefix=faults_prefix(init_seed_offset=1) if i == 2 else ()) for i in range(3)]
    for worker in workers[1:]:
        swarm.wait_ready(worker)
    odd = workers[2]
    try:
        poll_until(lambda: log_has(odd, "rejoining through weight sync"), 180, "the odd replica to resync",
                   period_s=0.3)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- the odd replica ---\n{odd.log_tail(60)}") from None
    poll_until(lambda: log_has(odd, "sync phase weight_sync -> active"), 90,
               "a full pass of rounds to bring it back", period_s=0.3)

    def rounds_after_rejoining():
        with open(odd.log_path, errors="replace") as f:
            return f.read().split("sync phase weight_sync -> active", 1)[-1].count("complete, group 3/3")

    poll_until(lambda: rounds_after_rejoining() >= 2, 60, "two complete rounds after it rejoined", period_s=0.3)
    for worker in workers:
        assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
    summary = odd.summary()
    counters = summary["averaging"]["counters"]
    assert counters.get("divergence_resyncs") == 1 and counters.get("rounds_diverged", 0) >= 2, counters
    phases = [span["phase"] for span in summary["sync_phases"]]
    assert phases == ["active", "weight_sync", "active"], summary["sync_phases"]
    assert "outlier" in summary["sync_phases"][1]["reason"]
    last = [r for r in summary["averaging"]["rounds"] if r["status"] == "complete"][-1]
    assert last["relative_distance"] < 0.05, last
    for worker in workers[:2]:
        assert worker.summary()["averaging"]["counters"].get("divergence_resyncs", 0) == 0, worker.name


@pytest.mark.timeout(240)
def test_a_worker_whose_averaging_stalls_leaves_its_stage_and_the_others_keep_averaging(make_swarm, run_config_path):
    """A sender that stalls mid-round in every round (test fault, 8 s against a 2 s sender
    timeout) is banned by the reducers, which complete the round without it; its own rounds
    fail while the stage averages, so the averaging rule (2 of the last 3) makes it leave with
    exit code 3 and its sentence, and the two others keep completing rounds. (Where replicas add
    up their gradients every step the rule only warns: `gradients: off` here.)"""
    config = run_config_path(stages=TWO_STAGES, averaging={**IDLE_ROUNDS, "gradients": "off"})
    swarm = make_swarm(config, common_args=COMMON)
    good = [swarm.start("worker", stage=0, args=["--reducer"], wait_ready=i == 0) for i in range(2)]
    swarm.wait_ready(good[1])
    stalled = swarm.start("worker", stage=0, prefix=faults_prefix(averaging_stall_s=8))
    assert swarm.wait(stalled, 150) == 3, stalled.log_tail()
    assert log_has(stalled, "self-termination rule averaging"), stalled.log_tail()
    assert not log_has(stalled, "node: worker failed"), "a rule exit is no bug: " + stalled.log_tail(60)
    terminated = poll_until(stalled.summary, 5, "the stalled worker's summary")["terminated_by"]
    assert terminated["rule"] == "averaging" and terminated["exit_code"] == 3, terminated

    def completed(worker):
        with open(worker.log_path, errors="replace") as f:
            return f.read().count("complete, group 2/2")

    before = [completed(w) for w in good]
    try:
        poll_until(lambda: all(completed(w) > b for w, b in zip(good, before)), 30,
                   "both others to complete a round after it left", period_s=0.3)
    except AssertionError as exc:  # once beside other tests in a clean-clone run: say what the rounds did
        rounds = []
        for worker in good:
            with open(worker.log_path, errors="replace") as f:
                lines = [line for line in f.read().splitlines() if "round" in line][-8:]
            rounds.append(f"--- {worker.name} (exit {worker.proc.poll()}) ---\n" + "\n".join(lines))
        raise AssertionError(f"{exc}\n" + "\n".join(rounds)) from None
    for worker in good:
        assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
