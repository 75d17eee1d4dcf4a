"""A SparseLoCo replica's fragment evidence (POST /v1/evidence, `kind: fragment`) on a real authorizer
and a real PostgreSQL 15, in a run that averages with SparseLoCo: three admitted workers of stage 1
on their own accounts sign their fragments of one round; one signed a pseudo-gradient 1000 times
too large, and a witness reports it. Evidence that holds bans the liar's account at once and its
credentials reach the revocation list; forged, mixed or single-account evidence bans nobody and is
recorded with its reporter flagged, as for a spot check's evidence (tests/authorizer/test_evidence.py)."""

from __future__ import annotations

import hashlib
import uuid

import numpy as np
import pytest
import torch

from protocol.codec import pack, unpack
from protocol.fragment_evidence import FragmentEvidence, SignedFragment
from protocol.run_config import dump_run_config, load_run_config
from roles.worker.layout import FlatLayout
from roles.worker.sparseloco.chunks import plan_fragments
from roles.worker.sparseloco.codec import Envelope, compress, encode_fragment
from tests.authorizer.helpers import ADMIN
from tests.authorizer.test_evidence import FLAGS, STAGE, Node, identity, open_run, report

pytestmark = pytest.mark.timeout(180)

RUN_ID, ROUND = "tiny", 20  # the run id the test keys sign their joins for
SPARSELOCO = {"chunk_size": 512, "topk_per_chunk": 16, "fragments": 1, "max_norm_ratio": 10.0}
LAYOUT = FlatLayout(["w", "b"], [(64, 96), (96,)])
[FRAGMENT] = plan_fragments(LAYOUT, chunk_size=512, topk=16, fragments=1)
BASE = torch.randn(FRAGMENT.numel, generator=torch.Generator().manual_seed(3))


def fragment(node: Node, scale: float = 1.0, *, round_id: int = ROUND) -> SignedFragment:
    """`node`'s signed fragment of a pseudo-gradient like its replicas', times `scale`."""
    noise = torch.randn(FRAGMENT.numel) * 0.1
    envelope = Envelope(RUN_ID, STAGE, round_id, 0, LAYOUT.digest, 512, 16, 2, sender=node.key.peer_id, anchor="ab")
    data = encode_fragment(compress((BASE + noise) * scale, FRAGMENT, 2), envelope, identity(node.key))
    return SignedFragment(peer_id=node.key.peer_id, data=data)


def evidence(accused: SignedFragment, *witnesses: SignedFragment) -> FragmentEvidence:
    return FragmentEvidence(run_id=RUN_ID, stage=STAGE, round=ROUND, fragment=0, tensor_names=LAYOUT.names,
                            tensor_shapes=[list(s) for s in LAYOUT.shapes], accused=accused, witnesses=list(witnesses))


@pytest.fixture(scope="module")
def run(module_starter, postgres, tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "sloco.yaml"
    dump_run_config(load_run_config("tiny", {"averaging": {
        "method": "sparseloco", "sparseloco": SPARSELOCO}}), path)
    authorizer = module_starter(*FLAGS, run_config=str(path),
                                db=postgres.create_database(f"fragments_{uuid.uuid4().hex[:12]}"))
    opened = open_run(authorizer)
    yield opened
    opened.http.close()


def cast(run) -> tuple[Node, Node, Node, Node]:
    """A liar and three honest replicas of stage 1, each on an account of its own."""
    tag = uuid.uuid4().hex[:8]
    return tuple(run.admit(f"{name}-{tag}") for name in ("liar", "first", "second", "third"))  # type: ignore


def test_fragment_evidence_that_holds_bans_the_liar_s_account_at_once(run):
    liar, first, second, third = cast(run)
    proof = evidence(fragment(liar, 1000.0), fragment(first), fragment(second), fragment(third))
    answer = report(run.http, proof, first.key)  # the reporter's own fragment is a witness
    assert answer.status_code == 200, answer.text
    upheld = answer.json()
    assert upheld["verdict"] == "upheld" and upheld["accused"] == liar.key.peer_id

    ended = run.http.get(f"/v1/join/{liar.ticket}").json()
    assert ended["status"] == "banned" and ended["rejection"]["reason"] == "banned_account"
    assert "SparseLoCo fragment 0 of round 20" in ended["rejection"]["message"]
    revoked = run.http.get("/v1/revocations").json()
    assert liar.serial in revoked["serials"] and liar.key.peer_id in revoked["peer_ids"]
    assert [run.status(n) for n in (first, second, third)] == ["admitted"] * 3

    [record] = [r for r in run.reports() if r["id"] == upheld["evidence_id"]]
    assert (record["kind"], record["version"], record["stage"]) == ("fragment", ROUND, STAGE)
    assert record["witness_peer_ids"] == [n.key.peer_id for n in (first, second, third)]
    assert record["reporter_peer_id"] == first.key.peer_id and record["accused_account_id"] == liar.account
    assert record["distances"] == [pytest.approx(1000.0, rel=0.05)]

    again = report(run.http, proof, second.key)
    assert again.json()["verdict"] == "already_revoked", again.text


def test_forged_or_unproven_fragment_evidence_bans_nobody_and_flags_the_reporter(run):
    liar, first, second, third = cast(run)
    accomplice = run.admit(run.name_of(liar.account))
    twin = run.admit(run.name_of(second.account))
    lie, one, two = fragment(liar, 1000.0), fragment(first), fragment(second)
    fields = unpack(unpack(lie.data)["m"])
    smaller = (np.frombuffer(fields["x"], dtype="<f4") / 1000).astype("<f4").tobytes()
    forged = SignedFragment(peer_id=liar.key.peer_id, data=pack({"m": pack({**fields, "x": smaller}),
                                                                  "g": unpack(lie.data)["g"]}))
    framed_fields = unpack(unpack(one.data)["m"])
    framed_fields["p"] = liar.key.peer_id  # the reporter's own lie, named as the liar's, signed by the reporter
    signed = pack({k: v for k, v in framed_fields.items()})
    first_identity = identity(first.key)
    framed = SignedFragment(peer_id=liar.key.peer_id, data=pack({
        "m": signed, "g": first_identity.sign(hashlib.sha256(signed).digest())}))
    revoked_before = run.http.get("/v1/revocations").json()
    cases = [
        (evidence(SignedFragment(peer_id=liar.key.peer_id, data=lie.data[:-1] + bytes([lie.data[-1] ^ 1])), one, two),
         "bad_signature"),
        (evidence(framed, fragment(third), two), "bad_signature"),
        (evidence(forged, one, two), "bad_signature"),
        (evidence(fragment(liar, 3.0), one, two), "accused_agrees"),
        (evidence(lie, one, fragment(second, 100.0)), "witnesses_disagree"),
        (evidence(lie, one, fragment(second, round_id=ROUND + 1)), "mismatched_fragment"),
        (evidence(lie, one, fragment(accomplice)), "same_account"),
        (evidence(lie, one, two, fragment(twin)), "witnesses_same_account"),
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
    assert all(r["verdict"] == "rejected" and r["kind"] == "fragment" and r["reporter_account_id"] == first.account
               for r in flagged)
    assert run.http.get("/v1/admin/evidence", params={"verdict": "upheld", "reporter": first.key.peer_id},
                        headers=ADMIN).json()["reports"] == []
