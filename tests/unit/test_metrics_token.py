"""Push tokens: what verifies, what does not and under which reason, and that no changed character
of a token ever verifies."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.credentials import (
    Credential, root_public_key_bytes, sign_credential, sign_revocation_list,
)
from protocol.errors import AuthError
from protocol.identity import Identity
from protocol.metrics_token import PushTokenError, _unb64, make_push_token, verify_push_token

ROOT = Ed25519PrivateKey.generate()
ROOT_PUBLIC = root_public_key_bytes(ROOT)
NOW = 1_800_000_000
NODE = Identity(Ed25519PrivateKey.generate(), path="")
OTHER = Identity(Ed25519PrivateKey.generate(), path="")


def credential_bytes(identity: Identity = NODE, root: Ed25519PrivateKey = ROOT, **overrides) -> bytes:
    fields = dict(run_id="run-a", peer_id=identity.peer_id.to_base58(), public_key=identity.public_key,
                  role="worker", stage=1, issued_at=NOW, expires_at=NOW + 1800, serial=42)
    fields.update(overrides)
    return sign_credential(root, Credential(**fields)).to_bytes()


def verify(token: str, **kwargs) -> Credential:
    kwargs.setdefault("root_public_key", ROOT_PUBLIC)
    kwargs.setdefault("run_id", "run-a")
    kwargs.setdefault("now", NOW + 10)
    return verify_push_token(token, **kwargs)


def reason_of(token: str, **kwargs) -> str:
    with pytest.raises(PushTokenError) as info:
        verify(token, **kwargs)
    assert isinstance(info.value, AuthError)
    assert str(info.value), "every refusal says what to do"
    return info.value.reason


def test_valid_token_returns_the_credential():
    token = make_push_token(NODE, credential_bytes(), now=NOW + 5)
    credential = verify(token)
    assert credential.peer_id == NODE.peer_id.to_base58() and credential.role == "worker" and credential.stage == 1
    assert "." in token and token.count(".") == 2 and "=" not in token and "/" not in token and "+" not in token


def test_expired_credential():
    token = make_push_token(NODE, credential_bytes(expires_at=NOW + 60), now=NOW + 4000)
    assert reason_of(token, now=NOW + 4000) == "credential_expired"


def test_wrong_root_key():
    token = make_push_token(NODE, credential_bytes(root=Ed25519PrivateKey.generate()), now=NOW + 5)
    assert reason_of(token) == "credential_bad_signature"


def test_other_run():
    token = make_push_token(NODE, credential_bytes(run_id="run-b"), now=NOW + 5)
    assert reason_of(token) == "credential_wrong_run"


def test_signed_by_another_key_than_the_credential_binds():
    """A credential read off the DHT is useless without its node's key."""
    token = make_push_token(OTHER, credential_bytes(), now=NOW + 5)
    assert reason_of(token) == "bad_signature"


@pytest.mark.parametrize("offset_s", [-301, 301, 100_000])
def test_stale_timestamp(offset_s):
    token = make_push_token(NODE, credential_bytes(), now=NOW + 10 + offset_s)
    assert reason_of(token) == "stale"


def test_timestamp_within_skew_verifies():
    assert verify(make_push_token(NODE, credential_bytes(), now=NOW + 10 - 299))
    assert verify(make_push_token(NODE, credential_bytes(), now=NOW + 10 + 299))


def test_revoked_by_serial_or_peer():
    token = make_push_token(NODE, credential_bytes(), now=NOW + 5)
    by_serial = sign_revocation_list(ROOT, run_id="run-a", serials=[42], issued_at=NOW)
    by_peer = sign_revocation_list(ROOT, run_id="run-a", peer_ids=[NODE.peer_id.to_base58()], issued_at=NOW)
    unrelated = sign_revocation_list(ROOT, run_id="run-a", serials=[7], peer_ids=[OTHER.peer_id.to_base58()],
                                     issued_at=NOW)
    assert reason_of(token, revocations=by_serial) == "credential_revoked"
    assert reason_of(token, revocations=by_peer) == "credential_revoked"
    assert verify(token, revocations=unrelated).serial == 42


def test_timestamp_is_signed():
    """Moving a stale token's timestamp forward breaks its signature."""
    token = make_push_token(NODE, credential_bytes(), now=NOW - 1000)
    credential, _, signature = token.split(".")
    assert reason_of(f"{credential}.{NOW + 10}.{signature}") == "bad_signature"


def test_credential_swapped_under_a_signature():
    """A signature over one credential does not carry over to another credential of the same node."""
    token = make_push_token(NODE, credential_bytes(), now=NOW + 5)
    other = make_push_token(NODE, credential_bytes(serial=43), now=NOW + 5)
    assert reason_of(".".join([other.split(".")[0], *token.split(".")[1:]])) == "bad_signature"


@pytest.mark.parametrize("token", [
    "", "abc", "a.b", "a.b.c.d", "a.12.c", "!!.12.AAAA", "AAAA.12.AAAA", "AAAA.-5.AAAA", "AAAA.1e9.AAAA",
    "x" * 20_000, "AAAA.١٢.AAAA",
])
def test_malformed(token):
    assert reason_of(token) == "malformed"


def test_not_a_string():
    assert reason_of(b"AAAA.12.AAAA") == "malformed"  # type: ignore[arg-type]


TOKEN = make_push_token(NODE, credential_bytes(), now=NOW + 5)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.integers(min_value=0, max_value=len(TOKEN) - 1),
       st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.="))
def test_tampered_token_never_verifies(position, replacement):
    if TOKEN[position] == replacement:
        return
    tampered = TOKEN[:position] + replacement + TOKEN[position + 1:]
    try:
        credential = verify(tampered)
    except PushTokenError:
        return
    # base64url's last character of a part may carry unused bits: a change there decodes to the same bytes
    assert credential == verify(TOKEN)
    assert [_unb64(p) if i != 1 else p for i, p in enumerate(tampered.split("."))] == \
        [_unb64(p) if i != 1 else p for i, p in enumerate(TOKEN.split("."))]
