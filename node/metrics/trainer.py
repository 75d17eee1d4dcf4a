"""A trainer's metrics: loss, tokens, samples by outcome, lanes and retries, the workers it can
route to per stage [report 3.4.4], and the held-out loss. All read from the role's own counters at
scrape time."""

from __future__ import annotations

from typing import Iterable, Optional

from node.metrics.registry import Families, Family, NodeMetrics
from roles.trainer.role import TrainerRole, TrainerState


def trainer_readiness(role: TrainerRole) -> Optional[str]:
    """None once the trainer drives samples and has announced itself, else why not."""
    if role.state == TrainerState.WAITING:
        return "waiting for a worker in every stage"
    if role.state != TrainerState.TRAINING:
        return f"trainer is {role.state.value}"
    if not role.announcer.announced:
        return "not announced in the DHT yet"
    return None


def attach_trainer(metrics: NodeMetrics, role: TrainerRole) -> None:
    metrics.bytes["pipeline"] = lambda: (role.client.bytes_sent, role.client.bytes_received)
    metrics.relayed_bytes.append(lambda: tuple(role.client.relayed_bytes))
    metrics.add("trainer", lambda f: _trainer(f, role))


def _trainer(f: Families, role: TrainerRole) -> Iterable[Family]:
    a = role.accounting
    yield f.gauge("agora_trainer_loss", f"mean loss of the last {a.recent_losses.maxlen} completed samples",
                  a.recent_loss)
    yield f.counter("agora_trainer_tokens_total", "tokens of the samples this trainer completed", a.tokens)
    yield f.gauge("agora_trainer_tokens_per_second", "tokens of completed samples per second over the last 30 s",
                  a.token_rate.rate())
    samples = {("completed", ""): a.completed}
    samples.update({("dropped", reason): n for reason, n in a.dropped_by_reason.items()})
    yield f.counters("agora_trainer_samples_total", "samples that ended, by outcome (completed, dropped) and, "
                     "for dropped ones, reason", ("outcome", "reason"), samples)
    yield f.gauge("agora_trainer_samples_in_flight", "samples started and not ended yet", a.in_flight)
    yield f.gauge("agora_trainer_lanes", "lanes this trainer drives samples on", role.config.lanes)
    yield f.gauge("agora_trainer_lanes_busy", "lanes holding a sample now", min(a.in_flight, role.config.lanes))
    yield f.counters("agora_trainer_retries_total", "calls retried on another worker, by cause (timeout, "
                     "unavailable, an error code; backward_fallback_* when a pinned backward had to move)",
                     ("reason", ), {(reason, ): n for reason, n in role.driver.retries.totals.items()})
    yield f.counters("agora_trainer_skipped_stages_total", "samples routed around a body stage that had no "
                     "reachable worker, by stage and pass (forward; backward when the stage's worker died "
                     "after the sample's forward)", ("worker_stage", "pass"),
                     {(str(stage), pass_): n for (stage, pass_), n in role.skipping.snapshot().items()})
    yield f.gauge("agora_trainer_global_step", "the latest global step a completed sample was tagged with",
                  a.last_step)
    yield f.gauges("agora_trainer_stage_workers", "workers this trainer can route to, per stage", "worker_stage",
                   {str(stage): n for stage, n in enumerate(role.discovery.workers_per_stage())})
    yield from _evaluation(f, role)


def _evaluation(f: Families, role: TrainerRole) -> Iterable[Family]:
    """The held-out loss: values on the evaluating trainer (trainer 0) once it has evaluated, no
    samples elsewhere (roles/trainer/evaluation.py)."""
    evaluator = role.evaluator
    latest = evaluator.latest if evaluator is not None else None
    yield f.gauge("agora_eval_loss", "mean loss on the held-out samples at the latest evaluation",
                  latest.loss if latest is not None else None)
    yield f.gauge("agora_eval_loss_stderr", "standard error of agora_eval_loss over the held-out samples",
                  latest.stderr if latest is not None else None)
    yield f.gauge("agora_eval_perplexity", "exp(agora_eval_loss)", latest.perplexity if latest is not None else None)
    yield f.gauge("agora_eval_step", "the stage step the latest evaluation was taken at",
                  latest.step if latest is not None else None)
    yield f.counter("agora_evaluations_total", "held-out evaluations that produced a loss",
                    evaluator.evaluations if evaluator is not None else None)
