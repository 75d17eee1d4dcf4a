"""`agora-node --role authorizer accounts add [--label TEXT] | list | revoke ACCOUNT_ID`.

The run's owner issues account tokens here and gives one to each contributor (`--account-token`).
The command works directly on the authorizer's database (the same `--data-dir`, or the `--db`
recorded there), whether the authorizer is running or not: each command is one short transaction
beside it, and the running authorizer reads accounts from the database on every join. The same
operations are in the admin API (`/v1/admin/accounts`).

`add` prints the token alone on stdout (so `TOKEN=$(agora-node --role authorizer accounts add)`
works) and what to do with it on stderr: the token is shown once, only its SHA-256 (the account
id) is kept. `revoke` takes the id or a unique prefix of at least 6 characters, as `list` shows it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from authorizer.config import AuthorizerConfig, default_data_dir, load_stored_settings
from protocol.errors import ConfigError
from protocol.exit_codes import ExitCode

SYNOPSIS = "agora-node --role authorizer accounts add [--label TEXT] | list | revoke ACCOUNT_ID [--data-dir DIR] [--db URL]"
MIN_PREFIX = 6


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ConfigError(f"{message}; usage: {SYNOPSIS}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="agora-node --role authorizer accounts", description="Issue, list and revoke account tokens.",
                usage=SYNOPSIS)
    p.add_argument("command", choices=["add", "list", "revoke"])
    p.add_argument("account_id", nargs="?", help="revoke: the account id (or a unique prefix) from `list`")
    p.add_argument("--label", default="", help="add: who the token is for (shown by list)")
    p.add_argument("--data-dir", help="the authorizer's data directory (default: $XDG_DATA_HOME/agora-node/authorizer)")
    p.add_argument("--db", help="the authorizer's database, if not the one recorded in the data directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--config", "--run-config", dest="run_config", help=argparse.SUPPRESS)  # not needed, accepted
    return p


def _open_store(args: argparse.Namespace):
    data_dir = args.data_dir or default_data_dir()
    db = args.db or load_stored_settings(data_dir).get("db")
    url = AuthorizerConfig(data_dir=data_dir, db=db).db_url()
    from authorizer.store import Store

    store = Store(url)
    store.open_for_accounts()
    return store


def _resolve(store, given: str) -> str:
    given = given.strip().lower()
    if len(given) < MIN_PREFIX:
        raise ConfigError(f"account id {given!r} is too short; give at least {MIN_PREFIX} characters of an id "
                          f"from `accounts list`")
    matches = [row.id for row in store.list_accounts() if row.id.startswith(given)]
    if not matches:
        raise ConfigError(f"no issued account has id {given}; `accounts list` shows them")
    if len(matches) > 1:
        raise ConfigError(f"{given} is the prefix of {len(matches)} accounts; give more of the id")
    return matches[0]


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def accounts_main(argv: Sequence[str]) -> int:
    """Run one accounts command; ConfigError propagates (one line, exit 2)."""
    args = list(argv)
    args.remove("accounts")
    parsed = _parser().parse_intermixed_args(args)
    if parsed.command == "revoke" and not parsed.account_id:
        raise ConfigError(f"accounts revoke needs ACCOUNT_ID (from `accounts list`); usage: {SYNOPSIS}")
    if parsed.command != "revoke" and parsed.account_id:
        raise ConfigError(f"accounts {parsed.command} takes no account id; usage: {SYNOPSIS}")
    from authorizer.admission import account_id, new_account_token
    from authorizer.store import create_account

    store = _open_store(parsed)
    try:
        if parsed.command == "add":
            token = new_account_token()
            with store.write_engine.begin() as conn:
                row = create_account(conn, store._insert, account_id(token), parsed.label, time.time())
            if parsed.json:
                print(json.dumps({"id": row.id, "label": row.label, "created_at": row.created_at, "token": token}))
            else:
                print(token, flush=True)
                print(f"account {row.id[:12]} created{f' ({parsed.label})' if parsed.label else ''}; give the "
                      f"token above to its contributor (--account-token): it is not stored and cannot be shown "
                      f"again", file=sys.stderr, flush=True)
        elif parsed.command == "list":
            rows = store.list_accounts()
            if parsed.json:
                print(json.dumps([{"id": r.id, "label": r.label, "created_at": r.created_at,
                                   "revoked_at": r.revoked_at, "banned": bool(r.banned)} for r in rows]))
            else:
                for r in rows:
                    state = "revoked " + _when(r.revoked_at) if r.revoked_at else ("banned" if r.banned else "active")
                    print(f"{r.id}  created {_when(r.created_at)}  {state:<24}  {r.label}")
                if not rows:
                    print("no accounts yet; create one with `agora-node --role authorizer accounts add`",
                          file=sys.stderr)
        else:
            target = _resolve(store, parsed.account_id)
            with store.write_engine.begin() as conn:
                was_active, ended = store.revoke_account_now(conn, target, time.time())
            if parsed.json:
                print(json.dumps({"id": target, "was_active": was_active, "ended_tickets": ended}))
            else:
                print(f"account {target[:12]} {'revoked' if was_active else 'was already revoked'}; "
                      f"{ended} live node(s) ended (their credentials are in the revocation list)")
        return ExitCode.OK
    finally:
        store.close()
