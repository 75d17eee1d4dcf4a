"""When the compute thread takes the stage's optimizer step [report 3.2, 3.3.1]: between two
batches it asks the step ledger (roles/worker/steps/step_ledger.py) whether the open step is due,
adds up the replicas' gradients first where the stage exchanges them, steps, and runs the hooks
that must see exactly that step (run checkpoints, averaging snapshots, SparseLoCo rounds). A worker
that holds nothing while samples two steps ahead arrive jumps to the run's step instead. The
head's forward allowance and the tail's room for untagged samples are read from the same counts.

`StepDecision` is a part of `StageRuntime` (roles/worker/serving/runtime.py), kept apart from the
loop that calls it: it reads the runtime's optimizer, ledger, queues and hooks, and is never built
on its own. Only the compute thread runs it, so a step always falls between two batches.
"""

from __future__ import annotations

import logging
from typing import Optional

from roles.worker.serving.queues import TaskKind
from roles.worker.steps.gradient_exchange import Contribution, StepSum
from roles.worker.steps.optimizer import NonFiniteGradients
from roles.worker.steps.step_ledger import StepDue

logger = logging.getLogger(__name__)


class StepDecision:
    """The step decision of `StageRuntime` (a mixin: the runtime holds the state)."""

    def arrived(self) -> tuple[int, int]:
        """Samples of the open step and of the next that reached this replica: accumulated here, or
        reported abandoned by their trainer (they complete the step without a gradient)."""
        opt, ledger = self.optimizer, self.ledger
        step = opt.local_step
        return (opt.samples_accumulated + ledger.abandoned(step), opt.next_accumulated + ledger.abandoned(step + 1))

    def _forward_allowance(self) -> Optional[int]:
        """Forwards the head may start now without delaying gradients beyond its bound.

        The tail tags samples in about the order the head forwarded them, so the samples in flight
        here fill the open step's remaining slots first; a forward beyond those belongs to the next
        step but runs on the open step's weights, so its gradient will be a step old. At most
        `max_delayed_per_step` such forwards run ahead; the rest wait for the step (0: the
        pipeline drains at every step, and no gradient is delayed). A forward whose backward has
        not come within `forward_gate_timeout_s` no longer holds a slot: its sample was probably
        dropped, and a gate waiting for it would stall the stage (a slow one costs a delayed
        gradient instead).
        """
        if self.max_delayed_per_step is None:
            return None
        open_samples, _ = self.arrived()
        remaining = self.ledger.target - open_samples - self.ledger.peers.counts.get(self.optimizer.local_step, 0)
        in_flight = self.forwarded.in_flight(self.forward_gate_timeout_s)
        return max(0, remaining + self.max_delayed_per_step - in_flight)

    def _untagged_capacity(self) -> tuple[int, int]:
        open_samples, next_samples = self.arrived()
        return self.ledger.capacity(self.optimizer.local_step, open_samples, next_samples, self.queues.max_batch)

    def _maybe_step(self) -> None:
        opt = self.optimizer
        with opt.lock:
            open_samples, next_samples = self.arrived()
            held, earliest = self.queues.held(opt.local_step + 1)
            exchanging = self.exchange_step is not None and bool(self.ledger.peers.members)
            if held and not open_samples and not next_samples and opt.samples_accumulated == 0 and (
                    not exchanging or self.ledger.may_jump_to(earliest)):
                self._jump_to(earliest)
                return
            # A tail waiting with untagged samples queued is waiting on this step too: the stage's
            # tagger gives them no tag until it closes (a tag handed to a replica that died leaves
            # a hole only the close timeout ends).
            waiting = held > 0 or (self.tagging is not None and self.queues.pending()[TaskKind.BACKWARD] > 0)
            due = self.ledger.due(opt.local_step, open_samples, next_samples > 0 or waiting, overtaken=held > 0)
            if due is None:
                return
            own = None
            step = opt.local_step
            # Samples of excluded replicas taken out on their behalf: with no replica to exchange
            # with, none of theirs is in this step, so there is nothing to take them out of.
            corrections = self.corrections.take(step)
            if exchanging:
                own = Contribution(peer="", step=step, samples=opt.samples_accumulated,
                                   abandoned=self.ledger.abandoned(step), grad=opt.open_gradient_sum(),
                                   consumed=opt.samples_consumed, corrections=corrections)
            else:
                self.counters["retractions_replica_gone"] += sum(c.samples for c in corrections)
        if own is not None:
            # The exchange waits for the other replicas; the lock stays free meanwhile (the averager
            # and the state server take it), and nothing accumulates since this thread waits.
            total = self.exchange_step(own)
            if total is None:  # stopping
                return
            for fix in corrections:  # the sum took them only if their replica's gradients are in it
                outcome = ("retractions_lost_late" if total.adopted_from is not None else
                           "retractions_summed" if fix.peer in total.members else "retractions_replica_gone")
                self.counters[outcome] += fix.samples
            due = StepDue(total.stage_samples, exchange_reason(total, due, self.ledger.target))
        with opt.lock:
            if own is not None:
                opt.set_open_gradient_sum(total.grad, total.samples)
                opt.samples_consumed = max(opt.samples_consumed, total.consumed)
            had_samples = opt.samples_accumulated > 0
            try:
                report = opt.step(stage_samples=due.stage_samples)
            except NonFiniteGradients as exc:
                self.counters["non_finite_steps"] += 1
                logger.error("%s", exc)
                report = None
                if self.on_step is not None:
                    self.on_step(False, str(exc))
            else:
                if had_samples and self.on_step is not None:
                    self.on_step(True, "")
            self.ledger.stepped(opt.local_step - 1, due)
            for hook in self.after_step:
                hook(opt.local_step)
        for hook in self.after_step_unlocked:
            hook(opt.local_step)
        if due.reason != "complete":
            why = {"peer_ahead": "a replica of this stage was ahead",
                   "peer_due": "a replica of this stage closed it",
                   "replica_lost": "a replica of this stage did not bring its gradients",
                   "adopted": "this replica came late and applied the sum the others stepped on",
                   "overtaken": "samples two steps ahead arrived; the rest of it was lost",
                   "timeout": f"no sample of it for {self.ledger.close_timeout_s:.0f}s"}[due.reason]
            logger.info("stage %d closed step %d with %d of %d samples (%s)", self.stage, opt.local_step - 1,
                        due.stage_samples, self.ledger.target, why)
        if report is not None:
            self.last_step = report
            logger.info("stage %d step %d: lr %.2e, grad norm %.3f%s, %d local samples", self.stage, report.step,
                        report.lr, report.grad_norm, " (clipped)" if report.clipped else "", report.samples)
        self.stepped.fire()
        self.changed.fire()

    def _jump_to(self, step: int) -> None:
        """Samples of a step two or more ahead arrived while this worker holds nothing: the run
        moved on without it (it was away, or it restarted a stage that had no replica left), so
        it joins the run's step at once instead of closing every step in between. With the
        stage's replicas adding up gradients, only when none of them can still close a skipped
        step (StepLedger.may_jump_to); else it closes them in turn through the exchange."""
        opt = self.optimizer
        skipped = step - opt.local_step
        opt.set_step(step, opt.samples_consumed + skipped * self.ledger.target)
        self.ledger.skipped(skipped)
        logger.info("stage %d jumped from step %d to %d: samples of step %d arrived and this worker held none of "
                    "the steps in between", self.stage, step - skipped, step, step)
        self.stepped.fire()
        self.changed.fire()


def exchange_reason(total: StepSum, due: StepDue, target: int) -> str:
    """Why the stage's step closed, once the replicas' gradients are added up."""
    if total.adopted_from is not None:
        return "adopted"
    if total.stage_samples >= target:
        return "complete"
    return "replica_lost" if total.missing else due.reason
