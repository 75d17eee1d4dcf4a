"""Credentials and revocation lists: what verifies, what does not and why, and that no single
changed byte of a presented credential ever verifies."""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.credentials import (
    DEFAULT_CREDENTIAL_TTL_S,
    BadSignature,
    Credential,
    CredentialError,
    CredentialExpired,
    CredentialNotYetValid,
    CredentialRejection,
    MalformedCredential,
    RevocationList,
    SignedCredential,
    UnsupportedCredentialVersion,
    WrongPeer,
    WrongRun,
    proof_bytes,
    renew_at,
    root_public_key_bytes,
    sign_credential,
    sign_revocation_list,
    verify_credential,
    verify_revocation_list,
)
from protocol.errors import AuthError
from protocol.identity import Identity

ROOT = Ed25519PrivateKey.generate()
ROOT_PUBLIC = root_public_key_bytes(ROOT)
NOW = 1_800_000_000
NODE = Identity(Ed25519PrivateKey.generate(), path="")
OTHER = Identity(Ed25519PrivateKey.generate(), path="")


def make(identity: Identity = NODE, **overrides) -> Credential:
    fields = dict(run_id="run-a", peer_id=identity.peer_id.to_base58(), public_key=identity.public_key,
                  role="worker", stage=1, issued_at=NOW, expires_at=NOW + DEFAULT_CREDENTIAL_TTL_S, serial=42)
    fields.update(overrides)
    return Credential(**fields)


SIGNED = sign_credential(ROOT, make())
BLOB = SIGNED.to_bytes()


def test_round_trip_from_model_and_from_bytes():
    peer = NODE.peer_id.to_base58()
    assert verify_credential(ROOT_PUBLIC, SIGNED, now=NOW + 5, peer_id=peer, run_id="run-a") == SIGNED.credential
    decoded = verify_credential(ROOT_PUBLIC, BLOB, now=NOW + 5, peer_id=peer)
    assert decoded == SIGNED.credential and decoded.stage == 1
    assert SignedCredential.from_bytes(BLOB) == SIGNED
    assert SignedCredential.model_validate_json(SIGNED.model_dump_json()) == SIGNED  # HTTP form: standard base64
    trainer = sign_credential(ROOT, make(role="trainer", stage=None))
    assert verify_credential(ROOT_PUBLIC, trainer.to_bytes(), now=NOW).stage is None


def test_another_root_key_is_rejected():
    forged = sign_credential(Ed25519PrivateKey.generate(), make())
    with pytest.raises(BadSignature) as info:
        verify_credential(ROOT_PUBLIC, forged, now=NOW)
    assert info.value.reason is CredentialRejection.BAD_SIGNATURE
    assert isinstance(info.value, AuthError)


def test_expired_and_not_yet_valid():
    with pytest.raises(CredentialExpired, match="renew"):
        verify_credential(ROOT_PUBLIC, SIGNED, now=NOW + DEFAULT_CREDENTIAL_TTL_S + 31)
    verify_credential(ROOT_PUBLIC, SIGNED, now=NOW + DEFAULT_CREDENTIAL_TTL_S + 29)  # within clock skew
    with pytest.raises(CredentialNotYetValid, match="NTP"):
        verify_credential(ROOT_PUBLIC, SIGNED, now=NOW - 31)
    verify_credential(ROOT_PUBLIC, SIGNED, now=NOW - 29)


def test_another_peers_credential_is_rejected():
    with pytest.raises(WrongPeer, match="cannot be lent"):
        verify_credential(ROOT_PUBLIC, SIGNED, now=NOW, peer_id=OTHER.peer_id.to_base58())
    # signed by the root, but naming a peer id whose key it does not carry
    mismatched = sign_credential(ROOT, make(public_key=OTHER.public_key))
    with pytest.raises(WrongPeer):
        verify_credential(ROOT_PUBLIC, mismatched, now=NOW)


def test_wrong_run_and_newer_version():
    with pytest.raises(WrongRun):
        verify_credential(ROOT_PUBLIC, SIGNED, now=NOW, run_id="run-b")
    future = sign_credential(ROOT, make(version=2))
    with pytest.raises(UnsupportedCredentialVersion):
        verify_credential(ROOT_PUBLIC, future, now=NOW)


@pytest.mark.parametrize("field,value", [
    ("serial", 43), ("stage", 2), ("role", "trainer"), ("expires_at", NOW + 10 * DEFAULT_CREDENTIAL_TTL_S),
    ("run_id", "run-b"), ("peer_id", OTHER.peer_id.to_base58()), ("public_key", OTHER.public_key),
], ids=["serial", "stage", "role", "expires_at", "run_id", "peer_id", "public_key"])
def test_tampered_field_is_rejected(field, value):
    tampered = SignedCredential(credential=SIGNED.credential.model_copy(update={field: value}),
                                signature=SIGNED.signature)
    with pytest.raises(BadSignature):
        verify_credential(ROOT_PUBLIC, tampered.to_bytes(), now=NOW)


def test_undecodable_input_is_malformed():
    for junk in (b"", b"\xc1", b"\x80", b"x" * 10, BLOB[:-1], BLOB + b"\x00"):
        with pytest.raises(MalformedCredential):
            verify_credential(ROOT_PUBLIC, junk, now=NOW)
    with pytest.raises(MalformedCredential):
        verify_credential(b"short", SIGNED, now=NOW)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(position=st.integers(min_value=0, max_value=len(BLOB) - 1), delta=st.integers(min_value=1, max_value=255))
def test_any_single_byte_change_fails_verification(position, delta):
    mutated = bytearray(BLOB)
    mutated[position] = (mutated[position] + delta) % 256
    with pytest.raises(CredentialError):
        verify_credential(ROOT_PUBLIC, bytes(mutated), now=NOW + 1)


@settings(max_examples=200, deadline=None)
@given(position=st.integers(min_value=0), delta=st.integers(min_value=1, max_value=255))
def test_any_single_byte_change_of_the_signed_bytes_breaks_the_signature(position, delta):
    data = bytearray(SIGNED.credential.signing_bytes())
    data[position % len(data)] = (data[position % len(data)] + delta) % 256
    from cryptography.exceptions import InvalidSignature

    with pytest.raises(InvalidSignature):
        ROOT.public_key().verify(SIGNED.signature, bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_only_ever_fail_as_credential_errors(data):
    with pytest.raises(CredentialError):
        verify_credential(ROOT_PUBLIC, data, now=NOW)


def test_renew_at_two_thirds_of_life():
    cred = make(issued_at=1000, expires_at=1000 + 1800)
    assert renew_at(cred) == pytest.approx(1000 + 1200)


def test_revocation_list_signature():
    revoked = sign_revocation_list(ROOT, run_id="run-a", serials=[42, 7, 42], peer_ids=["b", "a"], issued_at=NOW)
    assert revoked.serials == (7, 42) and revoked.peer_ids == ("a", "b")
    assert verify_revocation_list(ROOT_PUBLIC, revoked.to_bytes(), run_id="run-a").is_revoked(SIGNED.credential)
    assert verify_revocation_list(ROOT_PUBLIC, RevocationList.model_validate_json(revoked.model_dump_json()))
    assert not verify_revocation_list(ROOT_PUBLIC, sign_revocation_list(ROOT, run_id="run-a", issued_at=NOW)) \
        .is_revoked(SIGNED.credential)
    with pytest.raises(BadSignature):  # someone drops an entry to un-revoke a peer
        verify_revocation_list(ROOT_PUBLIC, revoked.model_copy(update={"serials": (7,)}))
    with pytest.raises(BadSignature):  # or replays an older list as new
        verify_revocation_list(ROOT_PUBLIC, revoked.model_copy(update={"issued_at": NOW + 100}))
    with pytest.raises(BadSignature):
        verify_revocation_list(ROOT_PUBLIC, sign_revocation_list(Ed25519PrivateKey.generate(), run_id="run-a"))
    with pytest.raises(WrongRun):
        verify_revocation_list(ROOT_PUBLIC, revoked, run_id="run-b")
    with pytest.raises(MalformedCredential):
        verify_revocation_list(ROOT_PUBLIC, b"\x93\x01")


def test_proofs_are_bound_to_action_run_peer_and_time():
    base = dict(run_id="run-a", peer_id=NODE.peer_id.to_base58(), signed_at=NOW)
    variants = {proof_bytes("renew", **base), proof_bytes("leave", **base),
                proof_bytes("renew", **{**base, "run_id": "run-b"}),
                proof_bytes("renew", **{**base, "peer_id": OTHER.peer_id.to_base58()}),
                proof_bytes("renew", **{**base, "signed_at": NOW + 1})}
    assert len(variants) == 5


def test_verification_is_cheap():
    peer = NODE.peer_id.to_base58()
    start = time.perf_counter()
    for _ in range(200):
        verify_credential(ROOT_PUBLIC, BLOB, now=NOW, peer_id=peer)
    assert (time.perf_counter() - start) / 200 < 0.005  # ~0.2 ms here; generous for slow CI


def test_every_position_of_the_presented_bytes_is_covered():
    for position in range(len(BLOB)):
        for delta in (1, 0x80, 0xFF):
            mutated = bytearray(BLOB)
            mutated[position] = (mutated[position] + delta) % 256
            with pytest.raises(CredentialError):
                verify_credential(ROOT_PUBLIC, bytes(mutated), now=NOW + 1)

