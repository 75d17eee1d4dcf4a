"""Evidence a node reports against a worker (`POST /v1/evidence`): checked, recorded, acted on.

Evidence (protocol/evidence.py) proves by itself that the accused signed a result which two other
replicas of its stage, given the same input at the same weight version, contradict. It cannot
prove that those two are honest: two colluding replicas can frame a third. So, beyond what the
evidence proves, the authorizer asks what only it knows: that all three are workers it admitted to
that stage, and that the witnesses are on accounts other than the accused's and other than each
other's (one account's word twice is one word). Evidence that holds bans the accused's whole
account through the admin API's ban (credentials revoked, the revocation list spreads as for any
ban); against an account banned or revoked already it answers `already_revoked` and bans nothing
new. A worker that joined without an account token is on the shared `anonymous` account: its peer
is banned instead, and two anonymous parties count as one account.

Evidence with one witness comes from a stage of two replicas: it proves that the two contradict
each other, and the reporter's loss measurement says which lied. A trainer can be wrong or lie
about that, so such a report bans at once only from an account in the policy's
`evidence_trusted_accounts` (the run owner's own trainers); from others it is `pending` until
reporters of `evidence_quorum` accounts (2 by default), none of them the accused's or the
witness's, have reported the same worker. A worker whose two signed answers to the same
computation contradict each other (the accused its own witness) has proven its lie by itself and
is banned at once.

A SparseLoCo replica reports fragment evidence (protocol/fragment_evidence.py): the accused's
signed fragment of a round against two to four other replicas' of the same round and fragment,
checked with the run config's SparseLoCo settings (roles/worker/sparseloco/evidence.py). The same
rules hold: every party an admitted worker of the stage, every witness on an account other than
the accused's and the other witnesses'. Fragment evidence that holds bans at once (two witnesses
of other accounts at least); in a run that does not average with SparseLoCo it is `wrong_run`.
The stored record's `kind` is `fragment`, its `version` the round, its first distance the
accused's norm over the witnesses' median.

An AsyncSPARTA reducer reports part evidence (protocol/part_evidence.py): the accused's sealed
all-reduce part of one group and part index against two to four other senders' of the same,
checked with the run config's `averaging.max_norm_ratio`. The same party rules hold, and evidence
that holds bans at once; in a run that does not average with AsyncSPARTA it is `wrong_run`. The
stored record's `kind` is `part`, its `version` the reporter's round number (not signed), its first
distance the accused's norm over the witnesses' median.

A report passes the cheap gates first, each with its typed error and nothing stored: the body's
size (413, authorizer.app, before anything is read) and its source's rate (429), its shape (400),
the reporter's signature time (401), a live credential of the reporter (403), its signature (401)
and the reporter's own rate (429). Past them every report is stored with its verdict, and rejected
evidence answers 400 `evidence_rejected` with its reason: nobody is banned, the reporter is flagged
in the record (`GET /v1/admin/evidence`). The tensors are not kept, only a digest of the body.
Decoding and comparing tensors of a 64 MiB body takes tens of milliseconds, so it runs off the
event loop, at most `MAX_CONCURRENT` reports at once.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import time
from typing import TYPE_CHECKING, NoReturn, Optional

from authorizer.errors import InvalidRequest, ProofRejected, RejectedEvidence, ReporterNotAdmitted
from authorizer.schema import ADMITTED
from authorizer.store import EvidenceBan
from protocol.authorizer_api import EvidenceOut, EvidenceReason
from protocol.errors import ProtocolError
from protocol.evidence import EvidenceRejected, check_evidence
from protocol.evidence_report import AnyEvidence, EvidenceReport, parse_evidence_report, report_signing_bytes
from protocol.fragment_evidence import FragmentEvidence
from protocol.identity import verify_signature
from protocol.part_evidence import PartEvidence, check_part_evidence
from protocol.run_config import RunConfig
from roles.worker.sparseloco.evidence import check_fragment_evidence

if TYPE_CHECKING:
    from authorizer.service import Authorizer

logger = logging.getLogger("agora.authorizer.evidence")

ANONYMOUS_ACCOUNT = "anonymous"
"""The account of every node that joined without a token (authorizer.admission.account_id)."""
MAX_CONCURRENT = 2


class EvidenceDesk:
    """Receives one run's evidence reports; `counts` are the verdicts so far by (verdict, reason)."""

    def __init__(self, authorizer: Authorizer, *, proof_window_s: float):
        self.authorizer = authorizer
        self.proof_window_s = proof_window_s
        """How far a report's signed_at may be from the authorizer's clock (that of renew proofs)."""
        self.counts: collections.Counter = collections.Counter()
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)

    async def report(self, body: bytes) -> EvidenceOut:
        """Judge the report in `body` (msgpack, protocol.evidence_report); EvidenceOut if it holds,
        else the typed error to answer with."""
        authorizer = self.authorizer
        async with self._slots:
            received_at = time.time()
            report, evidence, signed, body_sha256 = await asyncio.to_thread(_parse, body, authorizer.run.run_id)
            reporter = (report.reporter, await self._reporter_account(report, signed, received_at))
            refusal = authorizer.limiter.check_reporter(report.reporter)
            if refusal is not None:
                raise refusal
            parties = [evidence.accused.peer_id, *(w.peer_id for w in evidence.witnesses)]
            workers = await authorizer.read(authorizer.store.stage_workers, parties, evidence.stage)
            try:
                gaps = await asyncio.to_thread(_check, evidence, authorizer.run)
                _check_parties(evidence, workers)
            except EvidenceRejected as exc:
                await self._reject(evidence, exc, reporter, workers, received_at, body_sha256)
            return await self._uphold(evidence, gaps, reporter, workers, received_at, body_sha256)

    def _quorum(self, evidence: AnyEvidence, reporter: tuple[str, str]) -> tuple[Optional[int], str]:
        """How many reporters' accounts a ban on this evidence waits for (None: none), and how the
        ban's words name who proved it."""
        if isinstance(evidence, (FragmentEvidence, PartEvidence)):
            return None, f"{len(evidence.witnesses)} replicas of other accounts"
        if len(evidence.witnesses) == 2:
            return None, "two replicas of other accounts"
        if evidence.self_contradiction:
            return None, "its own second answer to the same input"
        policy = self.authorizer.policy
        if reporter[1] in policy.evidence_trusted_accounts:
            return None, "its stage's other replica, of another account, as a trusted account's trainer found"
        return policy.evidence_quorum, (f"its stage's other replica, of another account, as trainers of "
                                        f"{policy.evidence_quorum} accounts found")

    async def _reporter_account(self, report: EvidenceReport, signed: bytes, now: float) -> str:
        """The reporter's account, once its signature time, live credential and signature pass."""
        authorizer = self.authorizer
        window = self.proof_window_s
        if abs(now - report.signed_at) > window:
            raise ProofRejected(f"the report's signed_at is {report.signed_at - now:+.0f} s from the authorizer's "
                                f"clock (at most {window:g} s allowed); sign it with the current time (check NTP)")
        live = await authorizer.read(authorizer.store.live, report.reporter)
        if live is None or live.status != ADMITTED or (live.expires_at or 0) <= now:
            raise ReporterNotAdmitted(f"peer {report.reporter} holds no live credential of run "
                                      f"{authorizer.run.run_id}; only an admitted node may report evidence")
        if not verify_signature(live.public_key, signed, report.signature):  # Ed25519: tens of microseconds
            raise ProofRejected(
                f"the report's signature does not verify with the libp2p key of {report.reporter}; build the body "
                f"with protocol.evidence_report.evidence_report_body for run {authorizer.run.run_id!r}")
        return live.account_id

    async def _reject(self, evidence: AnyEvidence, exc: EvidenceRejected, reporter: tuple[str, str], workers: dict,
                      received_at: float, body_sha256: str) -> NoReturn:
        """Record rejected evidence, its reporter flagged, and answer RejectedEvidence."""
        accused = evidence.accused.peer_id
        record = _record(evidence, reporter, workers, received_at, body_sha256)
        message = (f"evidence against {accused} rejected ({exc.reason}): {exc}; nobody is banned, and the reporter "
                   f"is flagged in GET /v1/admin/evidence")
        record.update(reason=exc.reason, message=message[:512])
        evidence_id, _, _ = await self.authorizer.stored(self.authorizer.store.record_evidence(record))
        self.counts["rejected", exc.reason] += 1
        logger.warning("evidence #%d from %s (account %s) rejected (%s): %s", evidence_id, reporter[0],
                       reporter[1][:12], exc.reason, exc)
        raise RejectedEvidence(message, reason=exc.reason, evidence_id=evidence_id, accused=accused)

    async def _uphold(self, evidence: AnyEvidence, gaps: tuple[float, ...], reporter: tuple[str, str], workers: dict,
                      received_at: float, body_sha256: str) -> EvidenceOut:
        """Ban the accused's account (its peer, if anonymous) unless done already or, for a
        two-replica contradiction, until its quorum of reporters is reached; record it."""
        authorizer = self.authorizer
        accused = evidence.accused.peer_id
        account = workers[accused].account_id
        quorum, by_whom = self._quorum(evidence, reporter)
        if isinstance(evidence, FragmentEvidence):
            what = (f"stage {evidence.stage} SparseLoCo fragment {evidence.fragment} of round {evidence.round} "
                    f"whose norm is {gaps[0]:.3g}x the median of {by_whom}")
        elif isinstance(evidence, PartEvidence):
            what = (f"stage {evidence.stage} AsyncSPARTA all-reduce part {evidence.part_index} (round "
                    f"{evidence.round}) whose norm is {gaps[0]:.3g}x the median of {by_whom}")
        else:
            what = (f"stage {evidence.stage} {evidence.kind} at version {evidence.version} contradicted by {by_whom} "
                    f"(distance{'s' if len(gaps) > 1 else ''} {', '.join(f'{g:.4g}' for g in gaps)})")
        anonymous = account == ANONYMOUS_ACCOUNT
        ban = EvidenceBan(
            peer_id=accused if anonymous else None, account_id=None if anonymous else account,
            reason=lambda evidence_id: f"evidence #{evidence_id}: {what}"[:256],
            message=lambda evidence_id: (f"the authorizer banned this {'peer' if anonymous else 'account'}: "
                                         f"evidence #{evidence_id} shows its worker {accused} signed a {what}; "
                                         f"contact the operator if you think this is a mistake"),
            quorum=quorum,
            parties=frozenset(workers[w.peer_id].account_id for w in [evidence.accused, *evidence.witnesses]))
        record = _record(evidence, reporter, workers, received_at, body_sha256)
        target = "peer" if anonymous else "account"
        record.update(distance_1=gaps[0], distance_2=gaps[1] if len(gaps) > 1 else None,
                      message=lambda verdict: (f"{what}; {target} of {accused} banned once trainers of {quorum} "
                                               f"accounts report it" if verdict == "pending"
                                               else f"{target} of {accused} banned: {what}")[:512])
        evidence_id, verdict, ended = await authorizer.stored(authorizer.store.record_evidence(record, ban))
        self.counts[verdict, ""] += 1
        if verdict == "pending":
            logger.warning("evidence #%d against worker %s held (%s); banned once trainers of %d accounts report it",
                           evidence_id, accused, what, quorum)
        elif verdict == "upheld":
            authorizer.queue_wakeup.set()
            logger.warning("evidence #%d upheld: banned %s %s of worker %s (%s): %d live ticket(s) ended",
                           evidence_id, "peer" if anonymous else "account", accused if anonymous else account[:12],
                           accused, what, ended)
        else:
            logger.info("evidence #%d against worker %s: its %s is banned or revoked already", evidence_id, accused,
                        "peer" if anonymous else "account")
        return EvidenceOut(verdict=verdict, accused=accused, evidence_id=evidence_id)  # type: ignore[arg-type]


def _parse(body: bytes, run_id: str) -> tuple[EvidenceReport, AnyEvidence, bytes, str]:
    """The report, its evidence, what its reporter must have signed for `run_id`, and the body's
    SHA-256 (hex): everything that costs time in proportion to the body."""
    try:
        report, evidence = parse_evidence_report(body)
        signed = report_signing_bytes(run_id, report.evidence, report.signed_at)
    except (ProtocolError, ValueError, TypeError) as exc:  # TypeError, ValueError: what msgpack cannot pack again
        raise InvalidRequest(f"{str(exc)[:300]}; send the body protocol.evidence_report.evidence_report_body "
                             f"builds (msgpack)") from exc
    return report, evidence, signed, hashlib.sha256(body).hexdigest()


def _check(evidence: AnyEvidence, run: RunConfig) -> tuple[float, ...]:
    """What the evidence proves by itself (EvidenceRejected if nothing): a spot check's, the
    accused's distances from its witnesses; a fragment's or a part's, its norm over the witnesses'
    median."""
    if isinstance(evidence, PartEvidence):
        if run.averaging.method != "asyncsparta":
            raise EvidenceRejected(EvidenceReason.WRONG_RUN.value, f"run {run.run_id!r} averages with "
                                   f"{run.averaging.method}, not AsyncSPARTA: no all-reduce part is evidence here")
        return (check_part_evidence(evidence, run_id=run.run_id, max_norm_ratio=run.averaging.max_norm_ratio).ratio,)
    if not isinstance(evidence, FragmentEvidence):
        return check_evidence(evidence, run_id=run.run_id, tolerance=run.verification.tolerance)
    if run.averaging.method != "sparseloco":
        raise EvidenceRejected(EvidenceReason.WRONG_RUN.value, f"run {run.run_id!r} averages with "
                               f"{run.averaging.method}, not SparseLoCo: no fragment is evidence here")
    return (check_fragment_evidence(evidence, run_id=run.run_id, config=run.averaging.sparseloco).ratio,)


def _check_parties(evidence: AnyEvidence, workers: dict) -> None:
    """What only the authorizer knows: the parties are workers it admitted to the stage, each on
    an account of its own (EvidenceRejected if not)."""
    parties = [evidence.accused.peer_id, *(w.peer_id for w in evidence.witnesses)]
    missing = [peer for peer in parties if peer not in workers]
    if missing:
        raise EvidenceRejected(EvidenceReason.NOT_A_WORKER_OF_THE_STAGE.value,
                               f"{', '.join(missing)} was never admitted as a worker of stage {evidence.stage}")
    if evidence.self_contradiction:
        return  # its own word against itself
    accused, *witnesses = (workers[peer].account_id for peer in parties)
    if accused in witnesses:
        raise EvidenceRejected(EvidenceReason.SAME_ACCOUNT.value,
                               "a witness is on the accused's account: its word against its own account proves "
                               "nothing about the account")
    if len(set(witnesses)) != len(witnesses):
        raise EvidenceRejected(EvidenceReason.WITNESSES_SAME_ACCOUNT.value,
                               "two witnesses are on one account: one account's word twice")


def _record(evidence: AnyEvidence, reporter: tuple[str, str], workers: dict, received_at: float,
            body_sha256: str) -> dict:
    """The report's evidence_reports columns, but its verdict and what depends on it."""
    accused = workers.get(evidence.accused.peer_id)
    return dict(received_at=received_at, reporter_peer_id=reporter[0], reporter_account_id=reporter[1],
                accused_peer_id=evidence.accused.peer_id,
                accused_account_id=accused.account_id if accused else None,
                witness_peer_ids=[w.peer_id for w in evidence.witnesses], stage=evidence.stage,
                version=evidence.round if isinstance(evidence, (FragmentEvidence, PartEvidence)) else evidence.version,
                kind=evidence.kind, reason=None, distance_1=None, distance_2=None, message="",
                body_sha256=body_sha256)


def finite_or_none(value: Optional[float]) -> Optional[float]:
    """A stored distance as JSON carries it: an infinite one (different shapes) as null."""
    return value if value is not None and math.isfinite(value) else None
