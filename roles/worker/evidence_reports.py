"""What a replica's reports of a poisoned averaging contribution share, whichever room found it
(an AsyncSPARTA part, averaging/evidence.py; a SparseLoCo fragment, sparseloco/evidence.py): each
accused is reported at most once a round, each evidence is checked off the event loop as the
authorizer will check it, and a failure to check or send is logged and counted, never raised (a
report is a courtesy to the run; the round is over)."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Awaitable, Callable, Optional

from protocol.evidence import EvidenceNorms, EvidenceRejected

logger = logging.getLogger(__name__)

REPORTED_KEPT = 1024
"""(accused, round) pairs remembered so that each is reported once."""


class EvidenceReporter:
    """`check(evidence)` returns its norms or raises EvidenceRejected (it runs in a thread);
    `report(evidence)` sends it and returns the authorizer's verdict. `counts` by outcome: a
    verdict, `unproven` (the check refused it), `failed` (not sent), `invalid` (not built)."""

    party = "replica"
    """What the accused is called in the log."""

    def __init__(self, *, check: Callable[[Any], EvidenceNorms], report: Callable[[Any], Awaitable[str]]):
        self.check = check
        self.report = report
        self.counts: collections.Counter[str] = collections.Counter()
        self._reported: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()

    def first_report(self, accused: str, round_id: int) -> bool:
        """True the first time `accused` is named for `round_id` (and remembers it)."""
        key = (accused, round_id)
        if key in self._reported:
            return False
        self._reported[key] = None
        while len(self._reported) > REPORTED_KEPT:
            self._reported.popitem(last=False)
        return True

    def describe(self, evidence: Any) -> str:
        """Where the evidence comes from, for the log: e.g. `sparseloco round 5 fragment 2`."""
        raise NotImplementedError

    async def send(self, evidence: Any) -> Optional[str]:
        """Check `evidence` (in a thread) and report it; the verdict, or None if it was not sent."""
        accused, where = evidence.accused.peer_id[-8:], self.describe(evidence)
        try:
            norms = await asyncio.to_thread(self.check, evidence)
        except EvidenceRejected as exc:  # e.g. a witness the screen took but the check refuses
            self.counts["unproven"] += 1
            logger.warning("%s: no evidence against %s %s (%s): %s", where, self.party, accused, exc.reason, exc)
            return None
        try:
            verdict = await self.report(evidence)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the authorizer unreachable: a later round may try again
            self.counts["failed"] += 1
            logger.warning("could not report %s %s (%s) to the authorizer: %s: %s", self.party, accused, where,
                           type(exc).__name__, exc)
            return None
        self.counts[verdict] += 1
        logger.warning("evidence against %s %s (%s, norm %.3g, %.3gx the median of %d replicas) reported to the "
                       "authorizer: %s", self.party, accused, where, norms.accused, norms.ratio, len(norms.witnesses),
                       verdict)
        return verdict
