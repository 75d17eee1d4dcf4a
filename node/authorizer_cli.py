"""`agora-node --role authorizer`: the authorizer's command line, generated from its settings
model (authorizer/config.py) like every other role's, and its `accounts` commands.

Flags override what the data directory's `authorizer.json` recorded at the last start (host,
port, database, run config), which override the defaults: the same command after a restart
serves the same URL with the same root key.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from pydantic import ValidationError

from node.flags import OneLineErrorParser, add_model_flags
from protocol.errors import ConfigError
from protocol.exit_codes import EXIT_CODES, ExitCode

ACCOUNTS_SYNOPSIS = "agora-node --role authorizer accounts add [--label TEXT] | list | revoke ACCOUNT_ID [--data-dir DIR]"


def authorizer_parser() -> argparse.ArgumentParser:
    from authorizer.config import AuthorizerConfig

    codes = "\n".join(f"  {int(c):>3}  {EXIT_CODES[c].split(';')[0]}" for c in (ExitCode.OK, ExitCode.FAILURE))
    p = OneLineErrorParser(
        prog="agora-node --role authorizer", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="\n  agora-node --role authorizer [--config NAME|PATH] [--port 8000] [--policy-file PATH] [...]\n"
              f"  {ACCOUNTS_SYNOPSIS}",
        description="Run a training run's authorizer: it admits nodes, places workers on stages and signs\n"
                    "their credentials. Operating it: docs/operations.md.",
        epilog="Flags override what the data directory's authorizer.json recorded at the last start.\n\n"
               f"exit codes:\n{codes}\n    2  bad input: flags, config, policy file, database URL, port in use",
    )
    add_model_flags(p.add_argument_group("authorizer"), AuthorizerConfig, AuthorizerConfig.model_fields)
    return p


def config_from_args(args: argparse.Namespace):
    """Flags over what the data directory's authorizer.json recorded at the last start, over defaults."""
    from authorizer.config import STORED_FIELDS, AuthorizerConfig, default_data_dir, load_stored_settings

    values = {k: v for k, v in vars(args).items() if v is not None and v is not False}
    values["data_dir"] = values.get("data_dir") or default_data_dir()
    stored = load_stored_settings(values["data_dir"])
    for name in STORED_FIELDS:
        if name not in values and name in stored:
            values[name] = stored[name]
    try:
        return AuthorizerConfig(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error.get("loc", ("settings",))[0])
        extra = AuthorizerConfig.model_fields[field].json_schema_extra if field in AuthorizerConfig.model_fields else {}
        flag = "--" + str((extra or {}).get("flag", field)).replace("_", "-")
        raise ConfigError(f"{flag}: {str(error.get('msg', 'invalid')).removeprefix('Value error, ')}") from None


def authorizer_main(argv: Sequence[str]) -> int:
    """Serve until SIGINT/SIGTERM, or run one accounts command; ConfigError propagates (exit 2)."""
    argv = list(argv)
    if "accounts" in argv:
        from authorizer.accounts import accounts_main

        return accounts_main(argv)
    config = config_from_args(authorizer_parser().parse_args(argv))
    from authorizer.main import run_authorizer
    from node.logs import setup_logging

    setup_logging(config.log_level, config.log_format, "authorizer")
    if not config.no_monitor:
        from node.lifecycle import guard_children

        guard_children()  # the monitor's DHT process and p2pd die with the authorizer, even on SIGKILL
    return run_authorizer(config)

