"""Evidence against a worker (POST /v1/evidence) on a real authorizer and a real PostgreSQL 15: three
admitted workers of stage 1 on their own accounts sign their results (protocol.evidence), a
trainer reports the accused's contradicted result. Upheld evidence bans the accused's account and
its credentials reach the revocation list; the same evidence again answers already_revoked; every
kind of bad evidence is answered with its typed error, bans nobody, and is recorded with its
reporter flagged (GET /v1/admin/evidence); bad reporters and bad bodies are refused before
anything is recorded; one reporter's flood is answered 429. A worker without an account is banned
by its peer id. The node's client (node.admission) reports through the same endpoint."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from dataclasses import dataclass, field

import httpx
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from authorizer.errors import RejectedEvidence
from authorizer.testing import NodeKey
from node.admission import AuthorizerClient, EvidenceRefused
from protocol.authorizer_api import EVIDENCE_REJECTED
from protocol.codec import pack
from protocol.evidence import EVIDENCE_MAX_BYTES, Evidence, SignedResult, result_signing_bytes
from protocol.evidence_report import EVIDENCE_CONTENT_TYPE, evidence_report_body, report_signing_bytes
from protocol.identity import Identity
from protocol.messages import to_body
from tests.authorizer.helpers import ADMIN
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(180)

FLAGS = ("--checks", "capability,integrity,accountability", "--join-rate", "200", "--evidence-burst", "8")
STAGE, VERSION = 1, 7
TOKENS = torch.arange(16, dtype=torch.int64).reshape(1, 16)
COORDS = torch.linspace(-1, 1, 16 * 8).reshape(1, 16, 8)
HONEST = torch.linspace(0.5, 2.0, 16 * 8).reshape(1, 16, 8)
LIE = HONEST * 3


def identity(key: NodeKey) -> Identity:
    return Identity(key.private_key, path="")  # type: ignore[arg-type]


def signed(key: NodeKey, result: torch.Tensor, *, run_id: str = "tiny") -> SignedResult:
    data = result_signing_bytes(run_id, STAGE, VERSION, "output", TOKENS, COORDS, None, result)
    return SignedResult(peer_id=key.peer_id, result=result, attestation=key.sign(data))


def evidence(accused: SignedResult, *witnesses: SignedResult) -> Evidence:
    return Evidence(run_id="tiny", stage=STAGE, version=VERSION, kind="output", tokens=TOKENS, coords=COORDS,
                    accused=accused, witnesses=list(witnesses))


def report(http: httpx.Client, proof: Evidence, reporter: NodeKey, **kwargs) -> httpx.Response:
    body = evidence_report_body(proof, identity(reporter), **kwargs)
    return http.post("/v1/evidence", content=body, headers={"content-type": EVIDENCE_CONTENT_TYPE})


@dataclass
class Node:
    key: NodeKey
    ticket: str
    account: str
    serial: int


@dataclass
class Run:
    """An authorizer that admits workers of any stage asked for, and the nodes each test casts."""

    http: httpx.Client
    accounts: dict[str, tuple[str, str]] = field(default_factory=dict)

    def account(self, name: str) -> tuple[str, str]:
        """(token, account id) of a fresh issued account for `name` (unique per call site)."""
        if name not in self.accounts:
            created = self.http.post("/v1/admin/accounts", json={"label": name[:100]}, headers=ADMIN).json()
            self.accounts[name] = (created["token"], created["id"])
        return self.accounts[name]

    def name_of(self, account_id: str) -> str:
        return next(name for name, (_, issued) in self.accounts.items() if issued == account_id)

    def admit(self, account: str, *, role: str = "worker", stage: int = STAGE) -> Node:
        token, account_id = self.account(account)
        key = NodeKey.generate()
        body = key.join_body(role=role, account_token=token, preferred_stage=stage if role == "worker" else None)
        ticket = self.http.post("/v1/join", json=body).json()
        done = poll_until(lambda: (t := self.http.get(f"/v1/join/{ticket['ticket']}").json())["status"] == "admitted"
                          and t, 15, "admission")
        if role == "worker":
            assert done["stage"] == stage
        return Node(key, ticket["ticket"], account_id, done["admission"]["credential"]["credential"]["serial"])

    def cast(self) -> tuple[Node, Node, Node, Node]:
        """A fresh accused, two witnesses and a trainer reporting, each on an account of its own."""
        tag = uuid.uuid4().hex[:8]
        return (self.admit(f"accused-{tag}"), self.admit(f"first-{tag}"), self.admit(f"second-{tag}"),
                self.admit(f"reporter-{tag}", role="trainer"))

    def status(self, node: Node) -> str:
        return self.http.get(f"/v1/join/{node.ticket}").json()["status"]

    def reports(self, **params) -> list[dict]:
        return self.http.get("/v1/admin/evidence", params=params, headers=ADMIN).json()["reports"]


def open_run(authorizer) -> Run:
    http = httpx.Client(base_url=authorizer.url, timeout=60)
    assert http.patch("/v1/admin/policy", json={"honor_stage_preference": True}, headers=ADMIN).status_code == 200
    return Run(http)


@pytest.fixture(scope="module")
def run(module_starter, postgres):
    authorizer = module_starter(*FLAGS, db=postgres.create_database(f"evidence_{uuid.uuid4().hex[:12]}"))
    opened = open_run(authorizer)
    yield opened
    opened.http.close()


def test_the_error_codes_are_the_wire_contract():
    assert RejectedEvidence.code == EVIDENCE_REJECTED


@pytest.mark.parametrize("db_kind", ["sqlite", "postgres"])
def test_upheld_evidence_bans_the_account_and_revokes_its_credentials(start_authorizer, db_kind, tmp_path, request):
    db = (f"sqlite:///{tmp_path}/authorizer.db" if db_kind == "sqlite"
          else request.getfixturevalue("postgres").create_database(f"upheld_{uuid.uuid4().hex[:12]}"))
    run = open_run(start_authorizer(*FLAGS, db=db))
    accused, first, second, reporter = run.cast()
    sibling = run.admit(run.name_of(accused.account), stage=2)  # another worker of the accused's account
    proof = evidence(signed(accused.key, LIE), signed(first.key, HONEST), signed(second.key, HONEST.clone()))

    answer = report(run.http, proof, reporter.key)
    assert answer.status_code == 200, answer.text
    upheld = answer.json()
    assert upheld["verdict"] == "upheld" and upheld["accused"] == accused.key.peer_id and upheld["reason"] is None

    ended = run.http.get(f"/v1/join/{accused.ticket}").json()
    assert ended["status"] == "banned" and ended["rejection"]["reason"] == "banned_account"
    assert f"evidence #{upheld['evidence_id']}" in ended["rejection"]["message"]
    revoked = run.http.get("/v1/revocations").json()
    assert accused.serial in revoked["serials"] and accused.key.peer_id in revoked["peer_ids"]
    renewal = run.http.post("/v1/renew", json=accused.key.proof_body("renew", "tiny"))
    assert renewal.status_code == 403
    assert [run.status(n) for n in (first, second, reporter)] == ["admitted"] * 3
    banned = {a["id"]: a["banned"] for a in run.http.get("/v1/admin/accounts", headers=ADMIN).json()["accounts"]}
    assert banned[accused.account] is True and banned[first.account] is False
    assert run.status(sibling) == "banned" and sibling.serial in revoked["serials"]

    again = report(run.http, proof, reporter.key)
    assert again.status_code == 200, again.text
    assert again.json()["verdict"] == "already_revoked" and again.json()["evidence_id"] > upheld["evidence_id"]
    assert run.http.get("/v1/revocations").json()["serials"] == revoked["serials"]  # nothing new revoked

    newest, oldest = run.reports()
    assert (newest["verdict"], oldest["verdict"]) == ("already_revoked", "upheld")
    assert oldest["id"] == upheld["evidence_id"] and oldest["accused_account_id"] == accused.account
    assert oldest["reporter_peer_id"] == reporter.key.peer_id and oldest["reporter_account_id"] == reporter.account
    assert oldest["witness_peer_ids"] == [first.key.peer_id, second.key.peer_id]
    assert (oldest["stage"], oldest["version"], oldest["kind"]) == (STAGE, VERSION, "output")
    assert oldest["distances"] == [pytest.approx(2.0), pytest.approx(2.0)] and len(oldest["body_sha256"]) == 64
    metrics = poll_until(lambda: 'run="tiny",verdict="already_revoked"} 1.0' in (text := run.http.get("/metrics").text)
                         and text, 10, "the evidence counter")
    assert 'agora_authorizer_evidence_total{reason="",run="tiny",verdict="upheld"} 1.0' in metrics
    run.http.close()


def test_a_worker_without_an_account_is_banned_by_its_peer_id(start_authorizer):
    """Without accounts required, a worker that sent no token is on the shared `anonymous` account:
    banning that would ban every such node, so its peer is banned; and two anonymous witnesses
    count as one account."""
    run = open_run(start_authorizer("--checks", "capability,integrity", "--join-rate", "200"))
    run.accounts["anonymous"] = ("", "anonymous")
    accused, bystander, other = run.admit("anonymous"), run.admit("anonymous"), run.admit("anonymous")
    first, second = run.admit("alice-token"), run.admit("bob-token")
    reporter = run.admit("carol-token", role="trainer")
    lonely = report(run.http, evidence(signed(accused.key, LIE), signed(bystander.key, HONEST),
                                       signed(other.key, HONEST)), reporter.key)
    assert lonely.json()["error"]["reason"] == "same_account"
    answer = report(run.http, evidence(signed(accused.key, LIE), signed(first.key, HONEST),
                                       signed(second.key, HONEST)), reporter.key)
    assert answer.json()["verdict"] == "upheld", answer.text
    assert run.http.get(f"/v1/join/{accused.ticket}").json()["rejection"]["reason"] == "banned_peer"
    assert [run.status(n) for n in (bystander, other, first, second)] == ["admitted"] * 4
    witnesses = report(run.http, evidence(signed(first.key, LIE), signed(bystander.key, HONEST),
                                          signed(other.key, HONEST)), reporter.key)
    assert witnesses.json()["error"]["reason"] == "witnesses_same_account"
    run.http.close()


def test_bad_evidence_is_rejected_recorded_and_bans_nobody(run):
    accused, first, second, reporter = run.cast()
    accomplice = run.admit(run.name_of(accused.account))
    elsewhere = run.admit(f"elsewhere-{uuid.uuid4().hex[:8]}", stage=2)
    stranger = NodeKey.generate()  # never joined
    liar, one, two = signed(accused.key, LIE), signed(first.key, HONEST), signed(second.key, HONEST)
    tampered = SignedResult(peer_id=liar.peer_id, result=LIE * 1.5, attestation=liar.attestation)
    by_another = SignedResult(peer_id=accused.key.peer_id, result=LIE, attestation=one.attestation)
    revoked_before = run.http.get("/v1/revocations").json()
    cases = [
        (evidence(tampered, one, two), "bad_signature"),  # the accused's tensor changed after it signed
        (evidence(by_another, one, two), "bad_signature"),  # a signature by the wrong peer
        (evidence(liar, one, signed(second.key, HONEST * 2)), "witnesses_disagree"),
        (evidence(liar, one, signed(accomplice.key, HONEST)), "same_account"),
        (evidence(liar, one, signed(stranger, HONEST)), "not_a_worker_of_the_stage"),
        (evidence(liar, one, signed(elsewhere.key, HONEST)), "not_a_worker_of_the_stage"),  # admitted to stage 2
        (evidence(signed(accused.key, HONEST), one, two), "accused_agrees"),
    ]
    ids = []
    for proof, reason in cases:
        answer = report(run.http, proof, reporter.key)
        assert answer.status_code == 400, (reason, answer.text)
        error = answer.json()["error"]
        assert (error["code"], error["reason"], error["accused"]) == ("evidence_rejected", reason, accused.key.peer_id)
        assert "flagged" in error["message"]
        ids.append(error["evidence_id"])

    assert [run.status(n) for n in (accused, first, second, reporter, accomplice, elsewhere)] == ["admitted"] * 6
    assert run.http.get("/v1/revocations").json()["serials"] == revoked_before["serials"]
    flagged = run.reports(reporter=reporter.key.peer_id)
    assert [r["id"] for r in flagged] == ids[::-1]  # newest first
    assert [r["reason"] for r in flagged] == [reason for _, reason in cases][::-1]
    assert all(r["verdict"] == "rejected" and r["reporter_account_id"] == reporter.account and r["distances"] is None
               for r in flagged)
    assert flagged[0]["accused_account_id"] == accused.account
    assert {r["id"] for r in run.reports(verdict="rejected")} >= set(ids)
    assert not run.reports(verdict="upheld", reporter=reporter.key.peer_id)


def test_reporters_must_be_admitted_and_sign_freshly(run):
    accused, first, second, reporter = run.cast()
    proof = evidence(signed(accused.key, LIE), signed(first.key, HONEST), signed(second.key, HONEST))
    stranger = NodeKey.generate()
    refused = report(run.http, proof, stranger)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "reporter_not_admitted"
    banned = run.admit(f"banned-{uuid.uuid4().hex[:8]}", role="trainer")
    assert run.http.post("/v1/admin/bans", json={"peer_id": banned.key.peer_id}, headers=ADMIN).status_code == 200
    assert report(run.http, proof, banned.key).json()["error"]["code"] == "reporter_not_admitted"

    wire = to_body(proof)
    now = time.time()
    forged = pack({"evidence": wire, "reporter": reporter.key.peer_id, "signed_at": now,
                   "signature": stranger.sign(report_signing_bytes("tiny", wire, now))})
    wrong_run = pack({"evidence": wire, "reporter": reporter.key.peer_id, "signed_at": now,
                      "signature": reporter.key.sign(report_signing_bytes("another-run", wire, now))})
    for body in (forged, wrong_run):
        answer = run.http.post("/v1/evidence", content=body, headers={"content-type": EVIDENCE_CONTENT_TYPE})
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "bad_proof", answer.text
    stale = report(run.http, proof, reporter.key, signed_at=now - 600)
    assert stale.status_code == 401 and "signed_at" in stale.json()["error"]["message"]

    for who in (stranger, banned.key, reporter.key):
        assert not run.reports(reporter=who.peer_id)
    assert [run.status(n) for n in (accused, first, second)] == ["admitted"] * 3


def test_oversized_and_malformed_bodies_are_refused_before_anything_is_recorded(run):
    before = len(run.reports(limit=1000))
    status, error = _raw_post(run.http.base_url, EVIDENCE_MAX_BYTES + 1)  # the head only: the body is never read
    assert (status, error) == (413, "payload_too_large")
    garbage = [b"\xc1\xc1\xc1", b"not msgpack at all" * 10_000, pack([1, 2, 3]), pack({"evidence": {}}),
               pack({"evidence": {"run_id": "tiny"}, "reporter": "12D3KooW" + "a" * 44, "signed_at": time.time(),
                     "signature": bytes(64)})]
    accused, first, second, reporter = run.cast()
    wire = to_body(evidence(signed(accused.key, LIE), signed(first.key, HONEST), signed(second.key, HONEST)))
    wire["tokens"] = {"dtype": "int64", "shape": [1, 16], "data": b"\0" * 7}  # bytes that do not fit the shape
    garbage.append(pack({"evidence": wire, "reporter": reporter.key.peer_id, "signed_at": time.time(),
                         "signature": bytes(64)}))
    for body in garbage:
        answer = run.http.post("/v1/evidence", content=body, headers={"content-type": EVIDENCE_CONTENT_TYPE})
        assert answer.status_code == 400, answer.text  # larger than 64 KiB is no 413 here
        assert answer.json()["error"]["code"] == "invalid_request"
    assert "tensor data is 7 bytes" in answer.json()["error"]["message"]
    assert len(run.reports(limit=1000)) == before
    assert [run.status(n) for n in (accused, first, second)] == ["admitted"] * 3


def _raw_post(base_url, length: int) -> tuple[int, str]:
    """POST /v1/evidence announcing `length` body bytes and sending none; the answer's status and code."""
    import json

    with socket.create_connection((base_url.host, base_url.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/evidence HTTP/1.1\r\nHost: x\r\nContent-Type: {EVIDENCE_CONTENT_TYPE}\r\n"
                     f"Content-Length: {length}\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]["code"]


def test_a_flood_from_one_reporter_is_answered_429(run):
    accused, first, second, reporter = run.cast()
    proof = evidence(signed(accused.key, LIE), signed(first.key, HONEST), signed(second.key, HONEST))
    answers = [report(run.http, proof, reporter.key) for _ in range(12)]
    statuses = [a.status_code for a in answers]
    assert 429 in statuses, statuses
    limited = answers[statuses.index(429)]
    assert limited.json()["error"]["code"] == "rate_limited" and int(limited.headers["retry-after"]) >= 1
    assert statuses.index(429) >= 8 and set(statuses[:statuses.index(429)]) == {200}  # the burst (--evidence-burst)
    verdicts = [r["verdict"] for r in run.reports(reporter=reporter.key.peer_id, limit=1000)]
    assert verdicts.count("upheld") == 1 and len(verdicts) == statuses.count(200)  # a refused report is not stored
    other = run.admit(f"other-{uuid.uuid4().hex[:8]}", role="trainer")
    assert report(run.http, proof, other.key).json()["verdict"] == "already_revoked"  # per reporter, not per run


def test_the_node_client_reports_evidence(run):
    accused, first, second, reporter = run.cast()
    proof = evidence(signed(accused.key, LIE), signed(first.key, HONEST), signed(second.key, HONEST))
    disagreeing = evidence(signed(accused.key, LIE), signed(first.key, HONEST), signed(second.key, HONEST * 2))

    async def scenario():
        client = AuthorizerClient(str(run.http.base_url))
        try:
            with pytest.raises(EvidenceRefused) as rejected:
                await client.report_evidence(disagreeing, identity(reporter.key))
            assert (rejected.value.status, rejected.value.code, rejected.value.reason) == (
                400, "evidence_rejected", "witnesses_disagree") and rejected.value.evidence_id
            with pytest.raises(EvidenceRefused) as stranger:
                await client.report_evidence(proof, Identity(Ed25519PrivateKey.generate(), path=""))
            assert (stranger.value.status, stranger.value.code, stranger.value.reason) == (
                403, "reporter_not_admitted", None)
            upheld = await client.report_evidence(proof, identity(reporter.key))
            again = await client.report_evidence(proof, identity(reporter.key))
            return rejected.value.evidence_id, upheld, again
        finally:
            await client.close()

    rejected_id, upheld, again = asyncio.run(scenario())
    assert (upheld.verdict, upheld.accused, again.verdict) == ("upheld", accused.key.peer_id, "already_revoked")
    assert [r["id"] for r in run.reports(reporter=reporter.key.peer_id)] == [
        again.evidence_id, upheld.evidence_id, rejected_id]
    assert run.status(accused) == "banned"


def test_a_two_replica_contradiction_bans_once_reporters_of_two_accounts_agree(run):
    """One witness proves only that the pair contradict each other; which lied is the reporter's
    word. It is held `pending` until trainers of `evidence_quorum` (2) accounts, none of them a
    party's, have reported the worker; a trusted account's report bans at once."""
    accused, witness, _, reporter = run.cast()
    proof = evidence(signed(accused.key, LIE), signed(witness.key, HONEST))
    first = report(run.http, proof, reporter.key)
    assert first.status_code == 200 and first.json()["verdict"] == "pending", first.text
    same_account = run.admit(run.name_of(reporter.account), role="trainer")
    assert report(run.http, proof, same_account.key).json()["verdict"] == "pending"  # one account's word twice
    witness_trainer = run.admit(run.name_of(witness.account), role="trainer")
    assert report(run.http, proof, witness_trainer.key).json()["verdict"] == "pending"  # a party's word
    assert run.status(accused) == "admitted" and run.status(witness) == "admitted"
    pending = run.reports(verdict="pending", limit=1000)
    assert {r["reporter_peer_id"] for r in pending} >= {reporter.key.peer_id, witness_trainer.key.peer_id}
    held = next(r for r in pending if r["id"] == first.json()["evidence_id"])
    assert held["distances"] == [pytest.approx(2.0)] and held["witness_peer_ids"] == [witness.key.peer_id]
    assert "banned once trainers of 2 accounts report it" in held["message"]

    second = run.admit(f"second-reporter-{uuid.uuid4().hex[:8]}", role="trainer")
    upheld = report(run.http, proof, second.key)
    assert upheld.json()["verdict"] == "upheld", upheld.text
    assert run.status(accused) == "banned" and run.status(witness) == "admitted"
    ended = run.http.get(f"/v1/join/{accused.ticket}").json()
    assert "as trainers of 2 accounts found" in ended["rejection"]["message"]

    # the reverse accusation from the pair's other side proves as much, and is held the same way
    accused, witness, _, reporter = run.cast()
    swapped = evidence(signed(witness.key, HONEST), signed(accused.key, LIE))
    assert report(run.http, swapped, reporter.key).json()["verdict"] == "pending"
    agreeing = evidence(signed(accused.key, HONEST), signed(witness.key, HONEST))
    assert report(run.http, agreeing, reporter.key).json()["error"]["reason"] == "accused_agrees"

    # the run owner's own trainers: one report bans
    owner = run.admit(f"owner-{uuid.uuid4().hex[:8]}", role="trainer")
    trusted = run.http.patch("/v1/admin/policy", json={"evidence_trusted_accounts": [owner.account]}, headers=ADMIN)
    assert trusted.status_code == 200, trusted.text
    try:
        proof = evidence(signed(accused.key, LIE), signed(witness.key, HONEST))
        assert report(run.http, proof, owner.key).json()["verdict"] == "upheld"
        assert run.status(accused) == "banned"
    finally:
        run.http.patch("/v1/admin/policy", json={"evidence_trusted_accounts": []}, headers=ADMIN)


def test_a_worker_contradicting_itself_is_banned_on_one_report(run):
    """Its own two signed answers to one computation, further apart than the tolerance: no other
    replica's word is needed, so no quorum either."""
    accused, _, _, reporter = run.cast()
    answer = report(run.http, evidence(signed(accused.key, LIE), signed(accused.key, HONEST)), reporter.key)
    assert answer.status_code == 200 and answer.json()["verdict"] == "upheld", answer.text
    ended = run.http.get(f"/v1/join/{accused.ticket}").json()
    assert ended["status"] == "banned" and "its own second answer" in ended["rejection"]["message"]
    innocent, _, _, _ = run.cast()
    agrees = report(run.http, evidence(signed(innocent.key, HONEST), signed(innocent.key, HONEST.clone())),
                    reporter.key)
    assert agrees.json()["error"]["reason"] == "accused_agrees" and run.status(innocent) == "admitted"
