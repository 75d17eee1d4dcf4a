"""What a finished averaging round tells its replica [report 3.3.1.6, 5.7]: it is counted,
logged and published (`_finish`), its evidence of poisoned parts reported (`_report_parts`), fed
to the self-protection rule (roles/worker/health/round_health.py, resolved against what the other
replicas report: `_resolve_health`) and to the divergence watch (divergence.py: the stage's
outlier rejoins through weight sync), and checked against the index-set digests the other replicas
announce (`_check_index_sets`).

`RoundVerdicts` is a part of `AveragingService` (service.py), kept apart from the scheduling and
the rounds themselves: it reads the service's counters, history, schedule, health, divergence
watch and hooks, and is never built on its own.
"""

from __future__ import annotations

import logging

from protocol.dht_schema import AveragingRecord, Phase, RoundStatus, averaging_key
from roles.worker.averaging.rounds import RoundOutcome
from roles.worker.averaging.stage_view import StageView
from roles.worker.health.round_health import Verdict

logger = logging.getLogger(__name__)


class RoundVerdicts:
    """The round verdicts of `AveragingService` (a mixin: the service holds the state)."""

    def _resolve_health(self, view: StageView) -> None:
        if not self.health.pending:
            return
        survived = {
            (summary.kind, summary.round)
            for record in view.records.values()
            for summary in record.recent
            if summary.status in (RoundStatus.COMPLETE, RoundStatus.PARTIAL)
        }
        for (kind, round_id), verdict in self.health.resolve(survived):
            if verdict == Verdict.FAILURE:
                logger.warning("%s round %d failed here while other workers of the stage averaged", kind, round_id)
        reason = self.health.should_leave()
        if reason and self.gradients_exchanged:
            # The rule exists because a replica that misses rounds drifts from its stage; one
            # whose stage adds up its gradients every step applies the same updates as the others.
            logger.warning("stage %d: %s; the worker stays, since its stage's replicas add up their gradients "
                           "every step (averaging.gradients) and missed rounds do not set it apart", self.stage,
                           reason)
            self._counts["averaging_rule_waived"] += 1
            self.health.recent.clear()
            return
        self.leave_reason = reason
        if self.leave_reason:
            logger.error("leaving stage %d: %s [report 3.3.1.6]", self.stage, self.leave_reason)
            self.left.fire()

    def _judge_divergence(self, view: StageView, phase: Phase) -> None:
        """Judge the last round's distance against the others' (divergence.py): report a replica
        far off the average, and make the stage's outlier rejoin through weight sync."""
        judgement = self.divergence.judge(view.records.values(), started_at=self.started_at,
                                          stage_size=view.expected)
        if judgement is None:
            return
        if judgement.diverged:
            self._counts["rounds_diverged"] += 1
            logger.warning("stage %d replicas diverge: in %s round %d this replica sat %.3f (relative L2) from the "
                           "average, at or above averaging.max_divergence %g; the other members sat %s%s", self.stage,
                           judgement.kind, judgement.round, judgement.distance, self.config.max_divergence,
                           ", ".join(f"{d:.3f}" for d in judgement.others),
                           " (this replica is the outlier)" if judgement.outlier else "")
        if phase != Phase.ACTIVE or not self.divergence.must_resync():
            return
        reason = (f"this replica was the stage's outlier for {self.divergence.outlier_streak} rounds in a row "
                  f"(last: {judgement.distance:.3f} from the average, the others at most {max(judgement.others):.3f})")
        self.divergence.reset()
        self._counts["divergence_resyncs"] += 1
        try:
            self.on_divergent(reason)
        except Exception:  # noqa: BLE001 - a reporting hook must not break averaging
            logger.exception("resync callback failed")

    async def _check_index_sets(self, outcome: RoundOutcome) -> None:
        """Peers announce the digest of the round they are in and of their last rounds; one that
        announces a round this replica also ran with another digest computes other index sets
        (another config or version) and was kept out. The last rounds count too: a peer that
        started the round late (it joined, or its previous round ran long) announces it only
        after this replica looked."""
        try:
            records = await self.swarm.get(averaging_key(self.run_id, self.stage), AveragingRecord)
        except Exception:  # noqa: BLE001 - the check is best effort, the round itself is done
            logger.debug("could not read averaging records", exc_info=True)
            return
        mine = {(o.plan.kind, o.plan.round): o.digest for o in self.history if o.digest}
        mine[(outcome.plan.kind, outcome.plan.round)] = outcome.digest

        def differs(record: AveragingRecord) -> bool:
            announced = [(record.round_kind, record.round, record.digest)]
            announced += [(summary.kind, summary.round, summary.digest) for summary in record.recent]
            return any(digest and mine.get((kind, round_id), digest) != digest for kind, round_id, digest in announced)

        mismatched = sorted(peer for peer, record in records.items() if peer != self.swarm.peer_id and differs(record))
        if mismatched:
            self._counts["index_set_mismatches"] += len(mismatched)
            outcome.mismatched_peers = sorted(set(outcome.mismatched_peers) | set(mismatched))
            logger.warning("%d peer(s) of stage %d use another index set for rounds this worker ran (%s); they were "
                           "left out of those rounds: check that they run the same run config and agora-node version",
                           len(mismatched), self.stage, ", ".join(mismatched))

    def _finish(self, outcome: RoundOutcome, quiet: bool = False) -> None:
        """Count, log (`quiet`: at DEBUG, for rounds the cadence leaves out), publish and report a round."""
        repair = outcome.plan.kind == "repair"
        self._counts[f"rounds_{outcome.status.value}"] += 1
        if outcome.rejected_senders:
            self._counts["senders_rejected"] += len(outcome.rejected_senders)
        if outcome.unsigned_parts:
            self._counts["parts_unsigned"] += outcome.unsigned_parts
        found, outcome.part_evidence = outcome.part_evidence, []  # its part bytes are not kept in the history
        if found:
            self._report_parts(found)
        self.recent.append(outcome)
        self.history.append(outcome)
        if outcome.status != RoundStatus.SKIPPED:
            if outcome.allreduce_began:  # a round without a group lasts the matchmaking deadline
                self.schedule.finished(outcome.plan.kind, outcome.duration_s)
            self.round_seconds.observe(max(0.0, outcome.duration_s))
            if repair:  # what the repair brought back of the slices the round lost
                last = self.last_completeness or 0.0
                self.last_completeness = last + (1.0 - last) * (outcome.averaging_success or 0.0)
            else:
                self.last_completeness = outcome.averaging_success or 0.0
            self.bytes_sent += outcome.bytes_sent
            self.bytes_received += outcome.bytes_received
            if outcome.bytes_sent or outcome.bytes_received:
                self._seconds_moving += max(0.0, outcome.duration_s)
        if outcome.plan.phase == Phase.ACTIVE.value and not repair:
            self.divergence.observe(outcome.plan.kind, outcome.plan.round, outcome.status,
                                    outcome.relative_distance, len(outcome.group))
        if outcome.status in (RoundStatus.COMPLETE, RoundStatus.PARTIAL):
            self.health.record_success()
        elif outcome.status == RoundStatus.FAILED and not outcome.group_refused and not repair:
            # A refused group is the group's fault: a credentialed non-worker posing as the stage's
            # leader must not be able to push honest replicas out of their stage.
            self.health.record_failure(outcome.plan.kind, outcome.plan.round)
        level = logging.INFO if outcome.status in (RoundStatus.COMPLETE, RoundStatus.SKIPPED) else logging.WARNING
        if quiet:
            level = logging.DEBUG
        logger.log(level, "averaging: %s", outcome.describe())
        try:
            self.on_round(outcome)
        except Exception:  # noqa: BLE001 - a reporting hook must not break averaging
            logger.exception("round callback failed")
        self.announcer.poke()
