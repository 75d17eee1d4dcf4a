"""Trust benchmark: how fast the swarm stops routing to a worker that lies about its compute, what
the lie costs the model with the checks on and off, and what the checks cost honest runs. Prints
ONE JSON object on stdout (progress on stderr); `--out PATH` also writes it to a file.

Every run is bench_fidelity's demo swarm (the tiny preset, 3 stages x R workers, 2 trainers x 4
lanes, target batch 16; `--setting batch64`: target batch 64, 60 steps; real agora-node processes
on 127.0.0.1), with one worker's process
altered by the adversary harness (tests/support/adversary_node.py: its replies are altered, its
own training state stays honest). The attacker is replica 1 of the stage its lie comes out of:
stage 1 for outputs and input gradients, the tail (stage 2) for losses. `collude` is two liars in
adjacent stages (replica 1 of stages 0 and 1, both adding noise as large as their output).
`sloco_scale:100` lies in averaging instead: the run averages with SparseLoCo at 3 replicas a
stage (at least), and replica 1 of stage 1 signs its pseudo-gradient fragments times 100 while its
replies stay honest; its replicas refuse the fragments and, with `--authorizer`, report them as
fragment evidence (protocol/fragment_evidence.py). Its held-out gap is taken against the first
honest `sparseloco` run of the invocation (none: no gap). `spart_scale:100` is the same lie in
AsyncSPARTA's all-reduce (the run's default averaging, at 3 replicas a stage): replica 1 of stage 1
sends its sealed parts times 100 (every replica of such a run reduces, so it has reducers to lie
to), and its reducers refuse them and report them as part evidence
(protocol/part_evidence.py); its gap is taken against its own order only (the honest baseline has
another number of replicas).

For each attack, with the checks on (the run config's `verification`, spot checks at
`--spot-check-rate`, default 1%) and, with `--off`, with spot checks and the screen's checks at 0:

- samples until exclusion: the samples the attacker served, over both trainers, until the last
  trainer stopped routing to it (each trainer's `served_before_exclusion`, or with `--authorizer`
  all it served where the attacker was revoked and left first); null where a trainer never
  stopped routing to it, with what it served in `served_by_attackers`;
- false accusations: any worker but the attacker that a trainer excluded (and so reported, with
  an authorizer); `honest_strikes` counts the disputes resolved against honest workers, which
  exclude nobody below `strikes_to_exclude` (a dispute decided by the loss can go either way when
  the lie hardly moves it), or below `exact_strikes_to_exclude` when re-execution decided them;
- held-out loss (256 samples) of the elementwise mean of the final weights of the replicas still
  there at the end (a revoked attacker's last checkpoint is from when it left), and its gap to the
  honest run of the same invocation; also the mean of all replicas, as bench_fidelity takes it,
  and each replica's own model;
- the gap to its own order: the held-out loss against bench_fidelity's swarm-order reference
  trained on this run's own committed steps (the samples each step took, from the trainers'
  sample logs; same init, optimizers, held-out set), `own_order_reference_held_out_loss` and
  `gap_to_own_order`. Another run's sample order moves the held-out loss by about 1.4% at batch
  64, so only this gap shows 1%; the honest runs' gaps are its floor (`own_order.honest_floor`).
  The reference trains honestly on the samples the swarm committed: an attacked run's gap is what
  the lies cost the model (samples it dropped are missing from both);
- which mechanism struck an honest worker (`honest_strikes_by_mechanism`), and each trainer's
  `spot_checks` summary as it reported it;
- tokens/s from the trainers' start to their end.

`--routing workers` routes every run worker to worker (routing.path: workers), where a trainer
checks a worker's hops with what its neighbours kept (roles/trainer/chain_checks.py).

`--authorizer` admits every node through a real authorizer (honouring --stage, one account per
node, so the two trainers are on two accounts). A trainer whose check a third replica settles
(`--workers-per-stage 3`) sends the three signed results; with two replicas, each trainer sends the
pair's contradiction when it excludes the attacker, and the second such report reaches the
authorizer's default quorum of two accounts. `revoked_after_s` is when the authorizer first upheld
evidence against the attacker, in seconds since the trainers started (polled every 0.5 s);
`left_after_s` when the revoked attacker's process exited; `evidence` counts the verdicts.

`--honest N` adds N honest runs with the checks on (the baseline is the first, plain), cycling
through `--honest-variants` (default all but plain): `churn` (replica 1 of stage 1 killed at 40%
of the samples and restarted), `workers` (routing.path workers: samples hop worker to worker),
`mixed` (replica 1 of every stage runs its blocks under bfloat16 autocast, `--compute-dtype
bfloat16`, beside float32 replicas 0), `skipping` (both replicas of stage 1 killed at 40% and
restarted: the trainers skip the stage meanwhile), `sparseloco` (averaging with SparseLoCo at 3
replicas a stage, at least) and `early_departure` (replica 1 of stage 1 killed once one step's
samples are logged, never restarted); each counts accusations. `--off` adds an honest run with the checks
off: the overhead is its tokens/s against the honest runs' with them on, in the same invocation. `--overhead-pairs
N` adds N honest runs with the checks off, each followed by one with them on (`pair_ratios`: the
machine's drift cancels within a pair). Bytes added per sample are computed from the reply fields
that carry signatures and weight fingerprints (protocol/evidence.py), spot-check traffic aside.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a file: find the helpers
from _bench_common import emit_report, log, machine_info, rounded  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN_TOKEN = "bench-trust-admin-token-0123456789"

ATTACKS: dict[str, dict[str, list[str]]] = {
    # attack name -> {worker name: adversary specs}
    "noise:1": {"worker-s1-r1": ["noise:1"]},
    "noise:10": {"worker-s1-r1": ["noise:10"]},
    "scale:3": {"worker-s1-r1": ["scale:3"]},
    "bias:0.1": {"worker-s1-r1": ["bias:0.1"]},
    "swap": {"worker-s1-r1": ["swap"]},
    "stale:4": {"worker-s1-r1": ["stale:4"]},
    "zero_grad": {"worker-s1-r1": ["zero_grad"]},
    "flip_grad": {"worker-s1-r1": ["flip_grad"]},
    "noise:1,every:10": {"worker-s1-r1": ["noise:1,every:10"]},
    "loss:3": {"worker-s2-r1": ["loss:3"]},
    "collude": {"worker-s0-r1": ["noise:1"], "worker-s1-r1": ["noise:1"]},
    "sloco_scale:100": {"worker-s1-r1": ["sloco_scale:100"]},
    "spart_scale:100": {"worker-s1-r1": ["spart_scale:100"]},
}
DEFAULT_ATTACKS = tuple(ATTACKS)
SPARSELOCO_ATTACKS = ("sloco_scale:100",)
"""Attacks on averaging: the run averages with SparseLoCo, at `SPARSELOCO_REPLICAS` replicas a stage."""
AVERAGING_ATTACKS = (*SPARSELOCO_ATTACKS, "spart_scale:100")
"""Attacks on averaging, run at `SPARSELOCO_REPLICAS` replicas a stage (at least)."""
SPARSELOCO_REPLICAS = 3
"""Fragment and part evidence need two witnesses besides the accused (protocol/fragment_evidence.py,
protocol/part_evidence.py)."""
HONEST_VARIANTS = ("plain", "churn", "workers", "mixed", "skipping", "sparseloco", "early_departure")
MIXED_ARGS = ["--compute-dtype", "bfloat16"]
"""The `mixed` variant: replica 1 of every stage computes in bfloat16 beside replica 0's float32."""
SIGNATURE_BYTES, FINGERPRINT_BYTES = 64, 8


def trust_run_config(args: argparse.Namespace, steps: int, *, checks: bool, routing: str = "trainer",
                     sparseloco: bool = False, witnesses: bool = False):
    """bench_fidelity's demo run config at R replicas, with verification on or off; averaging with
    SparseLoCo (bench_fidelity's `--averaging-method sparseloco`), or with `witnesses` (evidence
    from averaging), at `replicas_for` replicas."""
    import bench_fidelity

    replicas = replicas_for(args, sparseloco or witnesses)
    fargs = bench_fidelity.parse_args(["--workers-per-stage", str(replicas), "--routing", routing,
                                       *(["--averaging-method", "sparseloco"] if sparseloco else [])])
    run = bench_fidelity.fidelity_run_config("trust", bench_fidelity.SETTINGS[args.setting], steps, fargs)
    verification = run.verification.model_copy(update={
        "spot_check_rate": args.spot_check_rate if checks else 0.0,
        "suspect_check_rate": run.verification.suspect_check_rate if checks else 0.0})
    update = {"verification": verification, "seed": args.seed}
    if witnesses and not sparseloco:
        # every replica reduces: an AsyncSPARTA liar scales the parts it sends the other reducers,
        # and the one reducer the run would promote may be the liar itself, with nobody to lie to
        update["averaging"] = run.averaging.model_copy(update={"min_reducers": replicas})
    return run.model_copy(update=update)


def replicas_for(args: argparse.Namespace, witnesses: bool) -> int:
    """Replicas a stage: `--workers-per-stage`, at least `SPARSELOCO_REPLICAS` where averaging
    evidence needs witnesses (SparseLoCo, an attack on averaging)."""
    return max(args.workers_per_stage, SPARSELOCO_REPLICAS) if witnesses else args.workers_per_stage


class Revocation:
    """Watches the authorizer's evidence record and the attackers' processes during a run."""

    def __init__(self, url: str, attackers: set[str]):
        self.url = url
        self.attackers = attackers
        self.peer_ids: dict[str, str] = {}
        self.upheld_at: dict[str, float] = {}
        self.left_at: dict[str, float] = {}
        self.rejected = 0
        self.pending = 0
        self._next_poll = 0.0

    def tick(self, swarm, elapsed: float) -> None:
        import httpx

        for node in swarm.nodes:
            if node.name in self.attackers:
                self.peer_ids.setdefault(node.name, node.peer_id)
                if node.proc.poll() is not None and node.name not in self.left_at:
                    self.left_at[node.name] = round(elapsed, 1)
        if elapsed < self._next_poll or len(self.upheld_at) == len(self.attackers):
            return
        self._next_poll = elapsed + 0.5
        try:
            reply = httpx.get(f"{self.url}/v1/admin/evidence", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                              timeout=5)
            body = reply.json()
        except Exception:  # noqa: BLE001 - a busy authorizer: ask again at the next tick
            return
        reports = body.get("reports", body) if isinstance(body, dict) else body
        by_peer = {peer: name for name, peer in self.peer_ids.items()}
        self.rejected = sum(1 for r in reports if r.get("verdict") == "rejected")
        self.pending = sum(1 for r in reports if r.get("verdict") == "pending")
        for report in reports:
            name = by_peer.get(report.get("accused_peer_id"))
            if name is not None and report.get("verdict") == "upheld":
                self.upheld_at.setdefault(name, round(elapsed, 1))


def one_run(label: str, args: argparse.Namespace, *, attack: Optional[str], checks: bool,
            variant: str = "plain") -> dict:
    """One swarm run; its figures, and its errors in "errors"."""
    import bench_fidelity
    from protocol.run_config import dump_run_config
    from tests.support.adversary_node import adversary_prefix

    steps = args.steps
    total = steps * bench_fidelity.SETTINGS[args.setting].target_batch_size
    workdir = tempfile.mkdtemp(prefix=f"agora-trust-{label.replace(':', '').replace(',', '-')}-")
    sparseloco = attack in SPARSELOCO_ATTACKS or variant == "sparseloco"
    witnesses = sparseloco or attack in AVERAGING_ATTACKS
    replicas = replicas_for(args, witnesses)
    routing = "workers" if variant == "workers" else args.routing
    run = trust_run_config(args, steps, checks=checks, routing=routing, sparseloco=sparseloco, witnesses=witnesses)
    run = run.model_copy(update={"run_id": f"trust-{os.getpid()}-{label.replace(':', '').replace(',', '-')}"})
    config_path = os.path.join(workdir, "run.yaml")
    dump_run_config(run, config_path)
    liars = ATTACKS[attack] if attack else {}
    prefixes = {name: adversary_prefix(*specs) for name, specs in liars.items()}
    log(f"[{label}] {'checks on' if checks else 'checks off'}, {variant}, attackers {sorted(liars) or 'none'}, "
        f"{steps} steps of {run.target_batch_size}")
    authorizer = revocation = None
    node_args = on_tick = None
    out: dict[str, Any] = {"attack": attack, "checks": checks, "variant": variant, "attackers": sorted(liars),
                           "averaging": run.averaging.method, "workers_per_stage": replicas, "routing": routing}
    started = time.monotonic()
    try:
        if args.authorizer:
            authorizer, node_args = _start_authorizer(config_path, workdir, replicas)
            revocation = Revocation(authorizer.url, set(liars))
            on_tick = revocation.tick
        swarm = bench_fidelity.run_swarm(run, config_path, workdir, bench_fidelity.SETTINGS[args.setting], total,
                                         replicas, churn=variant == "churn", prefixes=prefixes,
                                         skip_stage=variant == "skipping",
                                         **({"depart_at_samples": run.target_batch_size}
                                            if variant == "early_departure" else {}),
                                         node_args=_with_variant(node_args, variant), on_tick=on_tick)
        out.update(_figures(run, swarm, liars, total))
        if revocation is not None:
            _count_to_departure(out, revocation)
            out["revoked_after_s"] = {n: revocation.upheld_at.get(n) for n in sorted(liars)}
            out["left_after_s"] = {n: revocation.left_at.get(n) for n in sorted(liars)}
            out["evidence"] = {"rejected": revocation.rejected, "pending": revocation.pending,
                               "upheld": len(revocation.upheld_at)}
        if out["errors"]:
            log(f"[{label}] errors: {out['errors']}; logs kept in {workdir}")
    except Exception as exc:  # noqa: BLE001 - one run's failure is reported, the others still run
        out["errors"] = [f"{type(exc).__name__}: {exc}"]
        log(traceback.format_exc())
    finally:
        if authorizer is not None:
            authorizer.stop()
    out["wall_s"] = round(time.monotonic() - started, 1)
    if not out.get("errors") and not args.keep_logs:
        shutil.rmtree(workdir, ignore_errors=True)
    log(f"[{label}] held-out {out.get('held_out_loss')}, samples to exclusion {out.get('samples_to_exclusion')}, "
        f"gap to own order {out.get('gap_to_own_order')}, false accusations {out.get('false_accusations')}, "
        f"honest strikes {out.get('honest_strikes_by_mechanism')}, {out.get('tokens_per_s')} tokens/s, "
        f"{out['wall_s']:.0f}s")
    return out


def _with_variant(node_args: Optional[Callable[[str], list[str]]], variant: str
                  ) -> Optional[Callable[[str], list[str]]]:
    """The nodes' extra arguments, with the `mixed` variant's on replica 1 of every stage."""
    if variant != "mixed":
        return node_args
    return lambda name: [*(node_args(name) if node_args else []), *(MIXED_ARGS if name.endswith("-r1") else [])]


def _count_to_departure(out: dict, revocation: Revocation) -> None:
    """A revoked attacker that left is routed to by nobody from then on: a trainer that had not
    excluded it stopped with its departure, after all it served it."""
    for name, peer in out.get("attacker_peer_ids", {}).items():
        if out["samples_to_exclusion"].get(name) is not None or name not in revocation.left_at:
            continue
        out["samples_to_exclusion"][name] = sum(
            t["served_before_exclusion"].get(peer, t["served_by_attackers"].get(peer, 0))
            for t in out["trainers"].values())
    out["excluded_by_every_trainer"] = bool(out["samples_to_exclusion"]) and all(
        v is not None for v in out["samples_to_exclusion"].values())


def _start_authorizer(config_path: str, workdir: str, replicas: int):
    from authorizer.testing import AuthorizerProcess

    policy = os.path.join(workdir, "policy.yaml")
    with open(policy, "w") as f:
        f.write("honor_stage_preference: true\n")
    authorizer = AuthorizerProcess(
        ["--run-config", config_path, "--data-dir", os.path.join(workdir, "authorizer"), "--port", "0",
         "--credential-ttl-s", "1800", "--admin-token", ADMIN_TOKEN, "--policy-file", policy,
         "--stage-capacity", str(replicas), "--no-monitor"],
        log_path=os.path.join(workdir, "authorizer.log")).start()

    def node_args(name: str) -> list[str]:
        # one account per node: evidence needs the accused and its witnesses on three accounts
        return ["--authorizer", authorizer.url, "--account-token", f"account-{name}", "--revocation-refresh-s", "2"]

    return authorizer, node_args


def _figures(run, swarm: dict, liars: dict, total: int) -> dict:
    """Exclusions, accusations, held-out loss and throughput of one finished swarm run."""
    import bench_fidelity
    from _fidelity_reference import held_out_tokens

    errors = list(swarm.get("errors", []))
    summaries = swarm.get("summaries", {})
    peer_of = swarm.get("peer_ids", {})
    attackers = {peer_of.get(name) for name in liars} - {None}
    trainers = {name: s or {} for name, s in summaries.items() if name.startswith("trainer-")}
    name_of = {peer: name for name, peer in peer_of.items() if peer}
    per_trainer, accused, honest_strikes = {}, set(), 0
    by_mechanism: dict[str, int] = {}
    struck_honest: dict[str, int] = {}
    for name, summary in trainers.items():
        checks = summary.get("spot_checks") or {}
        excluded = checks.get("excluded") or {}
        accused |= set(excluded)
        honest_strikes += sum(n for peer, n in (checks.get("strikes") or {}).items() if peer not in attackers)
        for struck, by in (checks.get("strikes_by_mechanism") or {}).items():
            if struck not in attackers:
                for mechanism, n in by.items():
                    by_mechanism[mechanism] = by_mechanism.get(mechanism, 0) + n
                who = name_of.get(struck, struck[-8:])
                struck_honest[who] = struck_honest.get(who, 0) + sum(by.values())
        served = {peer: n for stage in (summary.get("served") or {}).values() for peer, n in stage.items()}
        per_trainer[name] = {
            "excluded": {p[-8:]: why for p, why in excluded.items()},
            "served_before_exclusion": {p[-8:]: n for p, n in (checks.get("served_before_exclusion") or {}).items()},
            "served_by_attackers": {p[-8:]: served.get(p, 0) for p in attackers},
            "checks": {k: checks.get(k) for k in ("agreed", "disputed", "unresolved", "diverged", "targeted",
                                                  "outlier", "tallied", "probation", "resolved", "evidence", "parted",
                                                  "largest_agreed_distance")},
            "replies_standing_out": {p[-8:] + (" (attacker)" if p in attackers else ""): n
                                     for p, n in ((checks.get("screening") or {}).get("outliers") or {}).items()},
            "samples_completed": summary.get("samples_completed"),
            "dropped": summary.get("dropped"),
            "discovery_empty_reads": summary.get("discovery_empty_reads", 0),
            "samples_skipping_a_stage": summary.get("samples_skipping_a_stage", 0),
            "spot_checks": checks,
        }
    samples_to_exclusion: dict[str, Optional[int]] = {}
    for name, peer in ((n, peer_of.get(n)) for n in sorted(liars)):
        counts = [((t.get("spot_checks") or {}).get("served_before_exclusion") or {}).get(peer) for t in trainers.values()]
        samples_to_exclusion[name] = None if not counts or any(c is None for c in counts) else sum(counts)
    false = sorted(p[-8:] for p in accused - attackers if p)
    completed = sum((t.get("samples_completed") or 0) for t in trainers.values())
    wall = swarm.get("train_wall_s")
    held_out, held_out_all, per_replica, written, tokens = None, None, [], [], None
    try:
        tokens = held_out_tokens(run, bench_fidelity.HELD_OUT_SAMPLES)
        found = [bench_fidelity.read_checkpoints(run, d) for d in swarm["checkpoint_dirs"]]
        replicas = [stages for stages, _ in found]
        written = [steps for _, steps in found]
        held_out = bench_fidelity.held_out_of(bench_fidelity.mean_of_replicas(run, _survivors(replicas, written)),
                                             tokens)
        per_replica = [bench_fidelity.held_out_of(stages, tokens) for stages in replicas]
        held_out_all = bench_fidelity.held_out_of(bench_fidelity.mean_of_replicas(run, replicas), tokens)
    except Exception as exc:  # noqa: BLE001 - a missing or garbled checkpoint: no held-out figure
        errors.append(f"held-out loss: {type(exc).__name__}: {exc}")
    if held_out is None:
        errors.append("no held-out loss: a stage has no final checkpoint")
    if completed < total:
        errors.append(f"{completed} of {total} samples completed")
    own = own_order_reference(run, swarm.get("sample_logs", []), written, tokens, errors)
    return {
        "attacker_peer_ids": {n: (peer_of.get(n) or "")[-8:] for n in sorted(liars)},
        "samples_to_exclusion": samples_to_exclusion,
        "excluded_by_every_trainer": bool(liars) and all(v is not None for v in samples_to_exclusion.values()),
        "false_accusations": false,
        "honest_strikes": honest_strikes,
        "honest_strikes_by_mechanism": dict(sorted(by_mechanism.items())),
        "honest_workers_struck": dict(sorted(struck_honest.items())),
        "held_out_loss": held_out,
        "own_order_reference_held_out_loss": own.get("held_out_loss"),
        "gap_to_own_order": relative_gap(held_out, own.get("held_out_loss")),
        "own_order_reference": own,
        "held_out_loss_mean_of_all_replicas": held_out_all,
        "held_out_loss_per_replica": per_replica,
        "checkpoint_steps_per_replica": written,
        "samples_completed": completed,
        "tokens_per_s": rounded(completed * run.seq_len / wall, 1) if wall else None,
        "train_wall_s": wall,
        "trainers": per_trainer,
        "churn": swarm.get("churn"),
        "errors": errors,
    }


STRIKE_MECHANISMS = {
    "arbiter": "a third replica's re-execution matched one side only",
    "self_contradiction": "asked again, the struck side's second answer contradicted its first",
    "reexecuted": "the trainer re-executed the hop on the struck side's own weights (fetched at the hop's version) "
                  "and got another output, or those weights did not carry the fingerprint it signed",
    "tally": "the tally of disputes within the loss margin (sign test over a pair's close disputes)",
    "loss": "an output dispute: the struck side's output carried the clearly worse loss through the later stages",
    "slope": "a gradient or tail-loss dispute: the struck side's slope error was the larger",
}
"""How a spot-check dispute was decided (roles/trainer/spot_checks.py `Dispute.mechanism`)."""


def own_order_reference(run, sample_logs: list[str], written: list[dict], held_out, errors: list[str]) -> dict:
    """bench_fidelity's swarm-order reference on this run's own committed steps: the one-process
    model (same seeded init, stage-wise optimizers and schedule) trained, honestly, on exactly the
    samples each step of the swarm committed per the trainers' sample logs, in the swarm's step
    order, then evaluated on the held-out set the swarm's model was. A step counts once the stages'
    surviving replicas all wrote a final checkpoint past it (a replica that left early is no part
    of the model, `_survivors`). Samples the trainers dropped or never completed (a reply screened
    out, an excluded worker's in-flight samples) are in no step's log, so the reference lacks them
    as the swarm does. What the workers took back out of a step (retractions of an excluded
    worker's samples, logged by the trainers) the reference takes out at the same stages. Each
    sample is taken at the weight versions its forward saw at each stage, as logged (bench_fidelity's
    stale replay): a sample whose forward ran a version behind at one stage (a pinned backward,
    its gradient a step old) moved an honest batch-64 run 1.25% from a reference that took every
    sample at its step's version. Failures go to `errors`; the figures are then {}."""
    import bench_fidelity
    from _fidelity_reference import OneProcessTrainer, SampleBank, StaleReplay, evaluate, loss_figures

    if held_out is None:
        return {}
    try:
        logged, bad = bench_fidelity.read_sample_logs(sample_logs)
        applied = _applied_step(written)
        steps = bench_fidelity.committed_steps(logged, applied)
        if not steps:
            errors.append("own-order reference: the trainers logged no committed step")
            return {}
        sizes = [len(v) for v in steps.values()]
        committed = {index for samples in steps.values() for index, _, _ in samples}
        retracted = {index: stages for index, stages in bench_fidelity.read_retractions(sample_logs).items()
                     if index in committed}
        started = time.monotonic()
        trainer, bank = OneProcessTrainer.for_stages(run), SampleBank(run)
        replay = StaleReplay(trainer)
        for step, samples in steps.items():
            if not samples:
                continue
            indices = [index for index, _, _ in samples]
            rows = {row: retracted[index] for row, index in enumerate(indices) if retracted.get(index)}
            # a sample whose versions were not logged (an older worker) is taken at its step's weights
            seen = [versions or (step,) * run.num_stages for _, _, versions in samples]
            replay.step(step, bank.tokens(indices), seen, rows)
        figures = loss_figures(trainer.history)
        figures["held_out_loss"] = round(evaluate(trainer.model, held_out), 4)
        figures["wall_s"] = round(time.monotonic() - started, 1)
        stale = sum(1 for step, samples in steps.items() for _, _, versions in samples
                    if versions and any(v != step for v in versions))
        log(f"  own-order reference: held-out {figures['held_out_loss']:.4f}, final train "
            f"{figures['final_train_loss']:.4f} ({figures['wall_s']:.0f}s)")
    except Exception as exc:  # noqa: BLE001 - the swarm's own figures stand without it
        errors.append(f"own-order reference: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
        return {}
    return {"held_out_loss": figures["held_out_loss"], "final_train_loss": figures["final_train_loss"],
            "steps": len(sizes), "samples": sum(sizes), "samples_per_step_min": min(sizes),
            "samples_per_step_max": max(sizes), "applied_step": applied,
            "samples_in_unapplied_steps": sum(len(v) for s, v in logged.items() if s not in steps),
            "retractions_replayed": sum(len(stages) for stages in retracted.values()),
            "samples_replayed_stale": stale,
            "unreadable_log_lines": bad, "wall_s": figures["wall_s"]}


def _applied_step(written: list[dict]) -> Optional[int]:
    """The step every stage reached: per stage the latest final checkpoint over its replicas (a
    replica that left early wrote an older one, or none), the least of those over the stages."""
    last: dict[int, int] = {}
    for steps in written:
        for stage, step in steps.items():
            if step is not None:
                last[stage] = max(last.get(stage, step), step)
    return min(last.values()) if last else None


def relative_gap(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """(a - b) / b, to 4 places; None when either is missing."""
    return None if a is None or b is None or not b else round((a - b) / b, 4)


def _survivors(replicas: list[dict], written: list[dict]) -> list[dict]:
    """Per replica, the stages whose final checkpoint is at the stage's last step: a worker that
    left early (revoked, killed) wrote its weights of then, which are no part of the run's model."""
    last = {}
    for steps in written:
        for stage, step in steps.items():
            if step is not None:
                last[stage] = max(last.get(stage, step), step)
    return [{stage: model for stage, model in stages.items() if steps.get(stage) == last.get(stage)}
            for stages, steps in zip(replicas, written)]


def bytes_per_sample(run) -> dict:
    """What signing adds to one sample's replies on the trainer's path, measured on the wire
    encoding of real replies with and without their signature and weights-fingerprint fields: a
    forward reply per stage but the tail's (the tail's backward recomputes its forward), a backward
    reply per stage (the head's has no input gradient to sign; the tail's signs its loss too)."""
    import torch

    from protocol.codec import pack
    from protocol.messages import BackwardReply, ForwardReply, to_body

    coords = torch.zeros(run.seq_len, 8)
    signed = {"weights": b"\x01" * FINGERPRINT_BYTES, "attestation": b"\x02" * SIGNATURE_BYTES}

    def added(plain, **fields) -> int:
        return len(pack(to_body(plain.model_copy(update=fields)))) - len(pack(to_body(plain)))

    forward = added(ForwardReply(coords=coords, version=3), **signed)
    head = added(BackwardReply(version=3, step=3), weights=signed["weights"])
    body = added(BackwardReply(grad_input=coords, version=3, step=3), **signed)
    tail = added(BackwardReply(grad_input=coords, loss=2.0, version=3, step=3), **signed,
                 loss_attestation=b"\x03" * SIGNATURE_BYTES)
    stages = run.num_stages
    total = (stages - 1) * forward + head + (stages - 2) * body + tail
    return {"forward_reply": forward, "head_backward_reply": head, "body_backward_reply": body,
            "tail_backward_reply": tail, "per_sample": total}


def summarize(runs: list[dict], baseline: Optional[dict], sparseloco_baseline: Optional[dict] = None) -> dict:
    """Per attack and checks on/off: samples to exclusion (median, max over runs), held-out gap to
    the honest baseline (an attack on SparseLoCo's: to the first honest SparseLoCo run, if any) and
    to each run's own-order reference (median, max), revocation seconds, honest strikes by how
    they were decided."""
    table: dict[str, dict] = {}
    for r in runs:
        if r.get("attack") is None:
            continue
        reference = sparseloco_baseline if r.get("averaging") == "sparseloco" else baseline
        if reference is not None and reference.get("workers_per_stage") != r.get("workers_per_stage"):
            reference = None  # another number of replicas: only the run's own order compares
        base = (reference or {}).get("held_out_loss")
        row = table.setdefault(r["attack"], {}).setdefault("on" if r["checks"] else "off", {
            "runs": 0, "samples_to_exclusion": [], "never_excluded": 0, "held_out_gaps": [],
            "revoked_after_s": [], "false_accusations": 0, "honest_strikes": 0, "own_order_gaps": [],
            "honest_strikes_by_mechanism": {}})
        row["runs"] += 1
        for n in (r.get("samples_to_exclusion") or {}).values():
            if n is None:
                row["never_excluded"] += 1
            else:
                row["samples_to_exclusion"].append(n)
        if base and r.get("held_out_loss") is not None:
            row["held_out_gaps"].append(relative_gap(r["held_out_loss"], base))
        if r.get("gap_to_own_order") is not None:
            row["own_order_gaps"].append(r["gap_to_own_order"])
        for mechanism, n in (r.get("honest_strikes_by_mechanism") or {}).items():
            row["honest_strikes_by_mechanism"][mechanism] = row["honest_strikes_by_mechanism"].get(mechanism, 0) + n
        row["revoked_after_s"] += [s for s in (r.get("revoked_after_s") or {}).values() if s is not None]
        row["false_accusations"] += len(r.get("false_accusations") or [])
        row["honest_strikes"] += r.get("honest_strikes") or 0
    for by_checks in table.values():
        for row in by_checks.values():
            found = row["samples_to_exclusion"]
            row["samples_to_exclusion_median"] = statistics.median(found) if found else None
            row["samples_to_exclusion_max"] = max(found) if found else None
            row.update(_median_max("own_order_gap", row["own_order_gaps"]))
    return table


def _median_max(name: str, values: list[float]) -> dict:
    return {f"{name}_median": statistics.median(values) if values else None,
            f"{name}_max": max(values) if values else None}


def honest_floor(honest: list[dict]) -> dict:
    """The honest runs' gaps to their own-order references, per variant and over the runs with the
    checks on: what a gap of an attacked run is read against."""
    by_variant: dict[str, list[float]] = {}
    for r in honest:
        if r.get("gap_to_own_order") is not None:
            by_variant.setdefault(f"{r['variant']}{'' if r['checks'] else ' (checks off)'}", []).append(
                r["gap_to_own_order"])
    on = [r["gap_to_own_order"] for r in honest if r["checks"] and r.get("gap_to_own_order") is not None]
    return {"by_variant": by_variant, **_median_max("own_order_gap", on),
            "own_order_gap_max_abs": max((abs(g) for g in on), default=None)}


OWN_ORDER_HOW_TO_READ = (
    "gap_to_own_order (per run) = held_out_loss / own_order_reference_held_out_loss - 1. The reference is "
    "scripts/bench_fidelity.py's swarm-order reference trained on that run's own steps: the same seeded init, "
    "stage-wise optimizers and schedule, the same 256 held-out samples, and per step exactly the samples the "
    "trainers' sample logs say the step committed, each taken at the weight versions its forward saw at each "
    "stage (samples_replayed_stale: those a version behind somewhere; a sample counts in the step it was "
    "logged with; steps past "
    "the last one every stage's surviving replicas checkpointed are left out, as the swarm's weights lack them). "
    "Samples the swarm dropped or excluded (a screened-out reply, an excluded or departed worker's in-flight "
    "samples) are in no step's log, so the reference lacks them too: it trains honestly on what the swarm "
    "committed, and an attacked run's gap is what the lies cost the model beyond the samples it lost, while "
    "held_out_gaps against the honest run also carry order noise (about 1.4% relative std at batch 64) and the "
    "lost samples. The honest runs' own-order gaps (honest_floor) are the floor: what the pipeline itself "
    "costs, which bench_fidelity measures at 0.0%. honest_strikes_by_mechanism: how each dispute resolved "
    "against an honest worker was decided (see strike_mechanisms), from each trainer's count of every strike by "
    "mechanism (spot_checks.strikes_by_mechanism).")


def _pair_ratios(honest: list[dict]) -> list[float]:
    """tokens/s of each checks-on run over the checks-off run just before it (--overhead-pairs)."""
    return [round(on["tokens_per_s"] / off["tokens_per_s"], 3) for off, on in zip(honest, honest[1:])
            if not off["checks"] and on["checks"] and off.get("tokens_per_s") and on.get("tokens_per_s")]


def _write(out: dict, path: str) -> None:
    import json

    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(out, indent=2, default=str) + "\n")
    os.replace(path + ".tmp", path)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attacks", default=";".join(DEFAULT_ATTACKS),
                   help=f"attacks to run, separated by ';' (default all: {'; '.join(DEFAULT_ATTACKS)}); '' for none")
    p.add_argument("--runs", type=int, default=1, metavar="N", help="runs per attack and setting (default 1)")
    p.add_argument("--off", action="store_true", help="also run every attack, and one honest run, with the checks off")
    p.add_argument("--honest", type=int, default=1, metavar="N",
                   help="honest runs with the checks on: the plain baseline, then --honest-variants in turn "
                        "(default 1: the baseline)")
    p.add_argument("--honest-variants", default=",".join(HONEST_VARIANTS[1:]), metavar="LIST",
                   help="the variants --honest cycles through after the plain baseline, comma-separated "
                        f"(default {','.join(HONEST_VARIANTS[1:])}; known: {','.join(HONEST_VARIANTS)})")
    p.add_argument("--overhead-pairs", type=int, default=0, metavar="N",
                   help="after the baseline, N honest runs with the checks off, each followed by one with them on, "
                        "for the overhead figure (default 0)")
    p.add_argument("--setting", choices=("demo", "batch64"), default="demo",
                   help="bench_fidelity's setting: demo (batch 16, 150 steps) or batch64 (batch 64, 60 steps)")
    p.add_argument("--steps", type=int, metavar="N",
                   help="optimizer steps per run (default: the setting's, 150 of 16 or 60 of 64 samples)")
    p.add_argument("--workers-per-stage", type=int, default=2, metavar="R", help="replicas of every stage (default 2)")
    p.add_argument("--routing", choices=("trainer", "workers"), default="trainer",
                   help="routing.path of every run: trainer (the trainer calls each stage) or workers (samples hop "
                        "worker to worker; checked through each worker's neighbours); the honest `workers` "
                        "variant routes worker to worker either way (default trainer)")
    p.add_argument("--spot-check-rate", type=float, default=0.01, help="verification.spot_check_rate (default 0.01)")
    p.add_argument("--authorizer", action="store_true",
                   help="admit every node through a real authorizer and time the revocation (needs 3 replicas a "
                        "stage for evidence)")
    p.add_argument("--seed", type=int, default=0, help="the run config's seed, the same for every run")
    p.add_argument("--out", metavar="PATH", help="also write the JSON result to PATH")
    p.add_argument("--keep-logs", action="store_true", help="keep every run's node logs and print where they are")
    args = p.parse_args(argv)
    args.attacks = [a.strip() for a in args.attacks.split(";") if a.strip()]
    unknown = [a for a in args.attacks if a not in ATTACKS]
    if unknown:
        p.error(f"unknown attack(s) {unknown}; known: {'; '.join(ATTACKS)}")
    args.honest_variants = [v.strip() for v in args.honest_variants.split(",") if v.strip()]
    if not args.honest_variants or any(v not in HONEST_VARIANTS for v in args.honest_variants):
        p.error(f"--honest-variants takes some of {','.join(HONEST_VARIANTS)}")
    if args.workers_per_stage < 2:
        p.error("--workers-per-stage must be at least 2: a check re-executes on another replica")
    if args.steps is None:
        import bench_fidelity

        args.steps = bench_fidelity.SETTINGS[args.setting].steps
    if args.overhead_pairs < 0:
        p.error("--overhead-pairs must be 0 or more")
    if args.runs < 1 or args.honest < 1 or args.steps < 1:
        p.error("--runs, --honest and --steps must be at least 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    sys.path.insert(0, REPO_ROOT)  # tests.support.adversary_node: the harness lives with the tests
    import bench_fidelity
    import torch

    torch.set_num_threads(1)
    started = time.monotonic()
    out: dict[str, Any] = {"benchmark": "trust", "machine": machine_info(),
                           "config": {"preset": "tiny", "stages": 3, "workers_per_stage": args.workers_per_stage,
                                      "trainers": 2, "lanes": 4, "setting": args.setting, "steps": args.steps,
                                      "samples": args.steps * bench_fidelity.SETTINGS[args.setting].target_batch_size,
                                      "spot_check_rate": args.spot_check_rate, "authorizer": args.authorizer,
                                      "routing": args.routing,
                                      "seed": args.seed}}
    runs: list[dict] = []
    honest: list[dict] = []
    errors: list[str] = []

    def report() -> dict:
        baseline = honest[0] if honest else None
        sparseloco_baseline = next((r for r in honest if r["checks"] and r["variant"] == "sparseloco"), None)
        on = [r["tokens_per_s"] for r in honest if r["checks"] and r.get("tokens_per_s") and r["variant"] == "plain"]
        off = [r["tokens_per_s"] for r in honest if not r["checks"] and r.get("tokens_per_s")]
        out["honest"] = {
            "runs": honest,
            "false_accusations": sum(len(r.get("false_accusations") or []) for r in honest if r["checks"]),
            "baseline_held_out_loss": (baseline or {}).get("held_out_loss"),
            "sparseloco_baseline_held_out_loss": (sparseloco_baseline or {}).get("held_out_loss"),
        }
        out["overhead"] = {
            "tokens_per_s_checks_on": on, "tokens_per_s_checks_off": off,
            "ratio": round(statistics.fmean(on) / statistics.fmean(off), 3) if on and off else None,
            "pair_ratios": _pair_ratios(honest),
            "bytes_added_per_sample": bytes_per_sample(trust_run_config(args, args.steps, checks=True)),
            "how_to_read": "ratio: mean tokens/s of the plain honest runs with the checks on over the honest runs "
                           "with them off, same invocation; pair_ratios: each --overhead-pairs off run's next "
                           "(checks on) run over it; bytes: what the signature and weights-fingerprint "
                           "fields add to one sample's replies on the wire",
        }
        out["attacks"] = summarize(runs, baseline, sparseloco_baseline)
        out["own_order"] = {"honest_floor": honest_floor(honest), "strike_mechanisms": STRIKE_MECHANISMS,
                            "how_to_read": OWN_ORDER_HOW_TO_READ}
        out["runs"] = runs
        out["errors"] = errors + [f"{r.get('attack') or r['variant']} ({'on' if r['checks'] else 'off'}): {e}"
                                  for r in [*honest, *runs] for e in r.get("errors", [])]
        out["elapsed_s"] = round(time.monotonic() - started, 1)
        return out

    def done(run: dict, into: list[dict]) -> None:
        into.append(run)
        if args.out:  # a long invocation keeps what it measured so far
            _write(report(), args.out)

    try:
        # the baseline first: a cut-short invocation keeps the most
        done(one_run("honest-0-plain", args, attack=None, checks=True), honest)
        for k in range(args.overhead_pairs):  # off then on, alternating: drift of the machine cancels
            done(one_run(f"overhead-{k}-off", args, attack=None, checks=False), honest)
            done(one_run(f"overhead-{k}-on", args, attack=None, checks=True), honest)
        if args.off:
            done(one_run("honest-off", args, attack=None, checks=False), honest)
        for k in range(args.runs):  # every attack once, the honest variants, then the attacks again
            for attack in args.attacks:
                done(one_run(f"{attack}-on-{k}", args, attack=attack, checks=True), runs)
                if args.off:
                    done(one_run(f"{attack}-off-{k}", args, attack=attack, checks=False), runs)
            for h in range(1, args.honest) if k == 0 else ():
                variant = args.honest_variants[(h - 1) % len(args.honest_variants)]
                done(one_run(f"honest-{h}-{variant}", args, attack=None, checks=True, variant=variant), honest)
    except KeyboardInterrupt:
        errors.append("interrupted")
    report()
    emit_report(out, args.out)
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
