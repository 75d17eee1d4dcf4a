"""Accounts that mean something: the run's owner issues and revokes tokens (command line and admin
API, on the same database, also while the authorizer runs); with accounts required only issued,
unrevoked tokens join, each refusal with its own reason; revoking an account ends its nodes and
revokes their credentials, as a ban does."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import httpx
import pytest

from authorizer.testing import NodeKey
from tests.authorizer.helpers import ADMIN
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(150)
REQUIRED = ("--checks", "capability,integrity,accountability", "--join-rate", "100")


def accounts_cli(data_dir: str, db: str, *args: str) -> subprocess.CompletedProcess:
    """`agora-node --role authorizer accounts ...`, as node.cli hands it to the authorizer."""
    return subprocess.run([sys.executable, "-m", "node.cli", "--role", "authorizer", "accounts", *args,
                           "--data-dir", data_dir, "--db", db], capture_output=True, text=True, timeout=60)


def join(http: httpx.Client, token: str, key: NodeKey | None = None) -> dict:
    response = http.post("/v1/join", json=(key or NodeKey.generate()).join_body(role="trainer", account_token=token))
    assert response.status_code == 200, response.text
    return response.json()


def admitted(http: httpx.Client, ticket: dict) -> dict:
    return poll_until(lambda: (t := http.get(f"/v1/join/{ticket['ticket']}").json())["status"] == "admitted" and t,
                      10, "admission")


def test_accounts_cli_beside_a_running_authorizer(start_authorizer, db_url, tmp_path):
    data = str(tmp_path / "data")
    authorizer = start_authorizer(*REQUIRED, db=db_url, data_dir=data)
    poll_until(lambda: "accounts: required" in authorizer.log_tail(), 10, "the accounts line")

    added = accounts_cli(data, db_url, "add", "--label", "alice")
    assert added.returncode == 0, added.stderr
    token = added.stdout.strip()
    assert len(added.stdout.splitlines()) == 1 and "not stored" in added.stderr
    account_id = hashlib.sha256(token.encode()).hexdigest()
    listed = accounts_cli(data, db_url, "list")
    assert listed.returncode == 0 and account_id in listed.stdout and "alice" in listed.stdout
    assert token not in listed.stdout

    with httpx.Client(base_url=authorizer.url, timeout=30) as http:
        unknown = join(http, "agora-not-issued-token")
        assert unknown["status"] == "rejected" and unknown["rejection"]["reason"] == "unknown_account"
        assert "accounts add" in unknown["rejection"]["message"]
        node = admitted(http, join(http, token))
        serial = node["admission"]["credential"]["credential"]["serial"]

        revoked = accounts_cli(data, db_url, "revoke", account_id[:10])
        assert revoked.returncode == 0 and "1 live node(s) ended" in revoked.stdout, revoked.stdout + revoked.stderr
        ended = http.get(f"/v1/join/{node['ticket']}").json()
        assert ended["status"] == "banned" and ended["rejection"]["reason"] == "revoked_account"
        assert serial in http.get("/v1/revocations").json()["serials"]
        refused = join(http, token)
        assert refused["status"] == "rejected" and refused["rejection"]["reason"] == "revoked_account"
    bad = accounts_cli(data, db_url, "revoke", "ffffffffff")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "accounts list" in bad.stderr


def test_accounts_admin_api_and_the_policy_it_serves(start_authorizer):
    authorizer = start_authorizer(*REQUIRED)
    with httpx.Client(base_url=authorizer.url, timeout=30) as http:
        assert http.get("/v1/run").json()["accounts_required"] is True
        assert http.post("/v1/admin/accounts", json={"label": "x"}).status_code == 401
        created = http.post("/v1/admin/accounts", json={"label": "bob"}, headers=ADMIN).json()
        assert created["id"] == hashlib.sha256(created["token"].encode()).hexdigest() and created["label"] == "bob"
        listing = http.get("/v1/admin/accounts", headers=ADMIN).json()["accounts"]
        assert [a["id"] for a in listing] == [created["id"]] and "token" not in listing[0]

        missing = join(http, "")
        assert missing["rejection"]["reason"] == "account_required"
        ticket = admitted(http, join(http, created["token"]))
        revoke = http.post(f"/v1/admin/accounts/{created['id']}/revoke", headers=ADMIN).json()
        assert revoke == {"id": created["id"], "was_active": True, "ended_tickets": 1}
        assert http.get(f"/v1/join/{ticket['ticket']}").json()["status"] == "banned"
        assert join(http, created["token"])["rejection"]["reason"] == "revoked_account"
        again = http.post(f"/v1/admin/accounts/{created['id']}/revoke", headers=ADMIN).json()
        assert again["was_active"] is False
        assert http.post(f"/v1/admin/accounts/{'0' * 64}/revoke", headers=ADMIN).status_code == 404

        # Not required: a token is not verified (any string joins), but a revoked one stays refused.
        assert http.patch("/v1/admin/policy", json={"checks": {"accountability": False}},
                          headers=ADMIN).status_code == 200
        assert http.get("/v1/run").json()["accounts_required"] is False
        assert join(http, "any-string-at-all")["status"] in ("queued", "admitted")
        assert join(http, created["token"])["rejection"]["reason"] == "revoked_account"


def test_a_new_run_does_not_require_accounts_and_says_so(start_authorizer):
    authorizer = start_authorizer()
    poll_until(lambda: "accounts: not required (any node meeting the checks may join)" in authorizer.log_tail(), 10,
               "the accounts line")
    assert httpx.get(f"{authorizer.url}/v1/run").json()["accounts_required"] is False
