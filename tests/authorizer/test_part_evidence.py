"""An AsyncSPARTA reducer's part evidence (POST /v1/evidence, `kind: part`) on a real authorizer and a
real PostgreSQL 15, in a run that averages with AsyncSPARTA (the default): four admitted workers
of stage 1 on their own accounts seal their all-reduce parts of one group and part index; one
sealed values 1000 times too large, and a reducer among the others reports it. Evidence that holds
bans the liar's account at once and its credentials reach the revocation list; forged, mixed or
single-account evidence bans nobody and is recorded with its reporter flagged, as for a fragment's
(tests/authorizer/test_fragment_evidence.py); malformed evidence is refused before anything is
recorded."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from protocol.codec import pack
from protocol.evidence_report import EVIDENCE_CONTENT_TYPE
from protocol.messages import to_body
from protocol.part_evidence import PartEvidence, PartProof, PartSigning, SignedPart
from tests.authorizer.helpers import ADMIN
from tests.authorizer.test_evidence import FLAGS, STAGE, Node, identity, open_run, report

pytestmark = pytest.mark.timeout(180)

RUN_ID, ROUND, GROUP, PART = "tiny", 30, b"group-of-round-30", 2
BASE = torch.randn(512, generator=torch.Generator().manual_seed(4))


def part(node: Node, scale: float = 1.0, *, values: torch.Tensor | None = None, group_id: bytes = GROUP,
         part_index: int = PART) -> SignedPart:
    """`node`'s sealed part of values like its replicas', times `scale`."""
    values = (BASE + torch.randn(512) * 0.05) * scale if values is None else values
    buffer = values.to(torch.float32).numpy().tobytes()
    signing = PartSigning(RUN_ID, STAGE, node.key.peer_id, identity(node.key).sign)
    seal = signing.seal(group_id, part_index, 5.0, 0, "float32", tuple(values.shape), buffer)
    return SignedPart.of(node.key.peer_id, PartProof(0, "float32", tuple(values.shape), buffer, 5.0, seal))


def evidence(accused: SignedPart, *witnesses: SignedPart) -> PartEvidence:
    return PartEvidence(run_id=RUN_ID, stage=STAGE, round=ROUND, group_id=GROUP, part_index=PART, accused=accused,
                        witnesses=list(witnesses))


@pytest.fixture(scope="module")
def run(module_starter, postgres):
    authorizer = module_starter(*FLAGS, db=postgres.create_database(f"parts_{uuid.uuid4().hex[:12]}"))
    opened = open_run(authorizer)
    yield opened
    opened.http.close()


def cast(run) -> tuple[Node, Node, Node, Node]:
    """A liar and three honest replicas of stage 1, each on an account of its own."""
    tag = uuid.uuid4().hex[:8]
    return tuple(run.admit(f"{name}-{tag}") for name in ("liar", "first", "second", "third"))  # type: ignore


def test_part_evidence_that_holds_bans_the_liar_s_account_at_once(run):
    liar, first, second, third = cast(run)
    proof = evidence(part(liar, 1000.0), part(first), part(second), part(third))
    answer = report(run.http, proof, first.key)  # the reporter's own part is a witness
    assert answer.status_code == 200, answer.text
    upheld = answer.json()
    assert upheld["verdict"] == "upheld" and upheld["accused"] == liar.key.peer_id

    ended = run.http.get(f"/v1/join/{liar.ticket}").json()
    assert ended["status"] == "banned" and ended["rejection"]["reason"] == "banned_account"
    assert f"AsyncSPARTA all-reduce part {PART} (round {ROUND})" in ended["rejection"]["message"]
    revoked = run.http.get("/v1/revocations").json()
    assert liar.serial in revoked["serials"] and liar.key.peer_id in revoked["peer_ids"]
    assert [run.status(n) for n in (first, second, third)] == ["admitted"] * 3

    [record] = [r for r in run.reports() if r["id"] == upheld["evidence_id"]]
    assert (record["kind"], record["version"], record["stage"]) == ("part", ROUND, STAGE)
    assert record["witness_peer_ids"] == [n.key.peer_id for n in (first, second, third)]
    assert record["reporter_peer_id"] == first.key.peer_id and record["accused_account_id"] == liar.account
    assert record["distances"] == [pytest.approx(1000.0, rel=0.05)]

    again = report(run.http, evidence(part(liar, 1000.0), part(second), part(first)), second.key)
    assert again.json()["verdict"] == "already_revoked", again.text


def test_forged_or_unproven_part_evidence_bans_nobody_and_flags_the_reporter(run):
    liar, first, second, third = cast(run)
    accomplice = run.admit(run.name_of(liar.account))
    twin = run.admit(run.name_of(second.account))
    lie, one, two = part(liar, 1000.0), part(first), part(second)
    framed = part(first, 1000.0).model_copy(update={"peer_id": liar.key.peer_id})  # sealed by the reporter
    revoked_before = run.http.get("/v1/revocations").json()
    cases = [
        (evidence(lie.model_copy(update={"buffer": one.buffer}), one, two), "bad_signature"),
        (evidence(framed, part(third), two), "bad_signature"),
        (evidence(part(liar, 1000.0, group_id=b"another group"), one, two), "bad_signature"),
        (evidence(part(liar, 3.0), one, two), "accused_agrees"),
        (evidence(lie, one, part(second, 100.0)), "witnesses_disagree"),
        (evidence(part(liar, values=BASE[:100] * 1000), one, two), "mismatched_part"),
        (evidence(lie, one, part(accomplice)), "same_account"),
        (evidence(lie, one, two, part(twin)), "witnesses_same_account"),
    ]
    ids = []
    for proof, reason in cases:
        answer = report(run.http, proof, first.key)
        assert answer.status_code == 400, (reason, answer.text)
        error = answer.json()["error"]
        assert (error["code"], error["reason"], error["accused"]) == ("evidence_rejected", reason, liar.key.peer_id)
        ids.append(error["evidence_id"])

    assert [run.status(n) for n in (liar, first, second, third, accomplice, twin)] == ["admitted"] * 6
    assert run.http.get("/v1/revocations").json()["serials"] == revoked_before["serials"]
    flagged = run.reports(reporter=first.key.peer_id)
    assert [r["reason"] for r in flagged] == [reason for _, reason in cases][::-1]
    assert all(r["verdict"] == "rejected" and r["kind"] == "part" and r["reporter_account_id"] == first.account
               for r in flagged)
    assert run.http.get("/v1/admin/evidence", params={"verdict": "upheld", "reporter": first.key.peer_id},
                        headers=ADMIN).json()["reports"] == []


def test_malformed_part_evidence_is_refused_before_anything_is_recorded(run):
    liar, first, second, _ = cast(run)
    before = len(run.reports(limit=1000))
    wire = to_body(evidence(part(liar, 1000.0), part(first), part(second)))
    broken = [
        {**wire, "witnesses": wire["witnesses"][:1]},
        {**wire, "accused": {**wire["accused"], "buffer": "text"}},
        {**wire, "accused": {**wire["accused"], "seal": b"short"}},
        {**wire, "group_id": b"g" * 100},
        {**wire, "part_index": "2"},
    ]
    for body in broken:
        answer = run.http.post("/v1/evidence", headers={"content-type": EVIDENCE_CONTENT_TYPE}, content=pack({
            "evidence": body, "reporter": first.key.peer_id, "signed_at": time.time(), "signature": bytes(64)}))
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "invalid_request"
    assert len(run.reports(limit=1000)) == before
    assert [run.status(n) for n in (liar, first, second)] == ["admitted"] * 3
