"""`agora-node`: parse flags, build settings, run the role, the authorizer or the demo.

The flags are generated from the settings models (node/flags.py), grouped by role. Bad input
ends with one line naming the fix and exit code 2, never a traceback; every exit code is in
protocol/exit_codes.py and shown by `--help`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from node.flags import OneLineErrorParser, add_field_flag, add_model_flags
from protocol.errors import AgoraError, ConfigError
from protocol.exit_codes import ExitCode, exit_code_table

SYNOPSIS = """
  agora-node --role worker  --authorizer URL [--stage N] [--identity PATH] [--max-batch N] [...]
  agora-node --role trainer --authorizer URL [--data synthetic|PATH] [--lanes N] [...]
  agora-node --role authorizer --config tiny|1b|8b|PATH.yaml [--port 8000] [...]
  agora-node --role worker --config 8b --stage N --dry-run [--gpu-memory 24GiB] [--host-memory 64GiB]
  agora-node --role monitor --authorizer URL --db URL [--account-token TOKEN] [...]
  agora-node --role relay --authorizer URL --account-token ADMIN_TOKEN [--host-maddrs MADDR] [...]
  agora-node status --authorizer URL | --initial-peers MADDR [--json] [--watch]
  agora-node plan --config PRESET|PATH [--stage N] [--json]
  agora-node data prepare INPUT... --output DIR [--train-tokenizer SIZE] [...]
  agora-node export --config RUN --checkpoint-store URL|--checkpoint FILE... --output DIR [--data PREPARED]
  agora-node generate --model DIR --prompt TEXT
  agora-node preempt --authorizer URL --peer PEER_ID --at MOMENT [...]
  agora-node demo [--help]
  agora-node --version"""

_METAVARS = {"config": "NAME|PATH", "data": "synthetic|PATH|URL", "data_dir": "DIR", "tokenizer": "PATH",
             "checkpoint_dir": "DIR", "checkpoint_store": "URL", "gpu_memory": "SIZE", "host_memory": "SIZE",
             "metrics_push": "URL", "relay": "auto|off|MADDR"}


def _version() -> str:
    from protocol.version import PROTOCOL_VERSION, client_version

    return f"agora-node {client_version()} (protocol {PROTOCOL_VERSION})"


def node_parser() -> argparse.ArgumentParser:
    from node.settings import COMMON_FIELDS, NodeSettings, ROLE_SECTIONS

    p = OneLineErrorParser(
        prog="agora-node", usage=SYNOPSIS, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Join a permissionless LLM pre-training run as a worker (holds one pipeline stage) or\n"
                    "a trainer (drives samples through the stages), or run the run's authorizer.",
        epilog="Every flag is also an AGORA_<FLAG> environment variable (AGORA_MAX_BATCH=4) and a key of\n"
               "the config file's 'node:' section; flags override the environment, which overrides the file.\n"
               "Authorizer flags: agora-node --role authorizer --help. Local demo swarm: agora-node demo --help.\n\n"
               f"exit codes:\n{exit_code_table()}",
    )
    p.add_argument("--version", action="version", version=_version())
    node = p.add_argument_group("every node")
    node.add_argument("--role", choices=["worker", "trainer", "authorizer", "monitor", "relay"], default=None,
                      help="what this node does (authorizer, monitor: see agora-node --role authorizer|monitor "
                           "--help; the run's state: agora-node status --help)")
    common = [n for n in NodeSettings.model_fields if n in COMMON_FIELDS and n != "role"]
    add_model_flags(node, NodeSettings, sorted(common, key=lambda n: n != "config"), _METAVARS)  # --config first
    worker, trainer = ROLE_SECTIONS["worker"].model_fields, ROLE_SECTIONS["trainer"].model_fields
    shared = [n for n in worker if n in trainer]
    add_model_flags(p.add_argument_group("worker"), ROLE_SECTIONS["worker"],
                    [n for n in worker if n not in shared], _METAVARS)
    add_model_flags(p.add_argument_group("trainer"), ROLE_SECTIONS["trainer"],
                    [n for n in trainer if n not in shared], _METAVARS)
    both = p.add_argument_group("worker and trainer")
    for name in shared:
        w, t = ROLE_SECTIONS["worker"].model_fields[name], ROLE_SECTIONS["trainer"].model_fields[name]
        help_text = None if w.default == t.default else (
            f"{w.description} (default: worker {w.default}, trainer {t.default})")
        add_field_flag(both, name, w, metavar=_METAVARS.get(name), help_text=help_text)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "demo":
            from node.demo import demo_main

            return demo_main(argv[1:])
        if argv and argv[0] == "status":
            from node.status_cli import status_main

            return status_main(argv[1:])
        if argv and argv[0] == "export":
            from node.export_cli import export_main

            return export_main(argv[1:])
        if argv and argv[0] == "generate":
            from node.export_cli import generate_main

            return generate_main(argv[1:])
        if argv and argv[0] == "data":
            from node.data_cli import data_main

            return data_main(argv[1:])
        if argv and argv[0] == "plan":
            from node.plan_cli import plan_main

            return plan_main(argv[1:])
        if argv and argv[0] == "preempt":
            from node.preempt_cli import preempt_main

            return preempt_main(argv[1:])
        if _role_of(argv) == "authorizer":
            return _run_authorizer(argv)
        if _role_of(argv) == "monitor":
            return _run_monitor(argv)
        if _role_of(argv) == "relay":
            return _run_relay(argv)
        code = _run(argv)
    except ConfigError as exc:
        print(f"agora-node: error: {exc}", file=sys.stderr, flush=True)
        code = ExitCode.USAGE
    except AgoraError as exc:
        code = getattr(exc, "exit_code", None)
        if code is None:
            _end_node(ExitCode.FAILURE, bug=True)
            raise
        print(f"agora-node: error: {exc}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        code = ExitCode.INTERRUPTED
    except SystemExit as exc:  # argparse: --help, --version, a bad flag
        if exc.code is None or isinstance(exc.code, int):
            _end_node(exc.code or ExitCode.OK)
        raise
    except BaseException:
        _end_node(ExitCode.FAILURE, bug=True)
        raise
    _end_node(code)
    return code


def _end_node(code: int, *, bug: bool = False) -> None:
    """A worker or trainer ends with the lifecycle's `exit_now`, whatever way out it took (a bug:
    after printing its traceback as the interpreter would). The interpreter's own teardown, a
    second or more with torch loaded, first restores the default signal actions: a signal arriving
    then would kill the node instead of being handled."""
    from node.lifecycle import exit_now, lifecycle

    if lifecycle().installed:
        if bug:
            sys.excepthook(*sys.exc_info())
        exit_now(code)


def _role_of(argv: list[str]) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg == "--role" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--role="):
            return arg.split("=", 1)[1]
    import os

    return os.environ.get("AGORA_ROLE") if "--role" not in argv else None


def _run_authorizer(argv: list[str]) -> int:
    """`agora-node --role authorizer ...`: the authorizer service or its accounts commands."""
    from node.authorizer_cli import authorizer_main

    code = authorizer_main(_without_role(argv))
    _exit_now(code)  # the authorizer imported torch through hivemind; tearing it down takes seconds
    return code


def _run_monitor(argv: list[str]) -> int:
    """`agora-node --role monitor ...`: the health monitor on its own (it runs inside the authorizer
    by default)."""
    from node.monitor_cli import monitor_main

    code = monitor_main(_without_role(argv))
    _exit_now(code)
    return code


def _run_relay(argv: list[str]) -> int:
    """`agora-node --role relay ...`: one of the run's relays (node/relay_cli.py)."""
    from node.relay_cli import relay_main

    code = relay_main(_without_role(argv))
    _exit_now(code)
    return code


def _without_role(argv: list[str]) -> list[str]:
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--role":
            skip = True
        elif not arg.startswith("--role="):
            rest.append(arg)
    return rest


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: everything of ours is closed and flushed by now."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def _run(argv: list[str]) -> int:
    from node.lifecycle import begin_process

    begin_process()  # signals and the watchdog first, before anything slow (node/lifecycle.py)
    args = vars(node_parser().parse_args(argv))  # before the heavy imports: bad flags fail fast
    from node.settings import build_settings

    settings = build_settings(args)
    from node.daemon import configure_logging, run_node

    configure_logging(settings.log_level, settings.log_format, settings.role)
    return run_node(settings)


if __name__ == "__main__":
    sys.exit(main())
