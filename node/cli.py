"""`agora-node`: parse flags, build settings, run the role or the demo. Bad input ends with one
line naming the fix and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from protocol.errors import AgoraError, ConfigError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints usage; we print one actionable line
        raise ConfigError(f"{message} (see agora-node --help)")


def node_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="agora-node", description="Join a permissionless LLM pre-training run.",
                epilog="Run 'agora-node demo --help' for the local demo swarm. Every flag can also be set as an "
                       "AGORA_<FLAG> environment variable or in the config file's 'node:' section.")
    p.add_argument("--role", choices=["worker", "trainer", "authorizer"],
                   help="what this node does (authorizer: see agora-node --role authorizer --help)")
    p.add_argument("--config", help="run config: tiny, 1b, 8b or a YAML path")
    p.add_argument("--stage", type=int, help="pipeline stage served by a worker")
    p.add_argument("--authorizer", metavar="URL", help="the run's authorizer; admits this node and signs its credential")
    p.add_argument("--account-token", help="account token the run owner gave you, if any")
    p.add_argument("--insecure-open-run", action="store_true", default=None,
                   help="join a run without an authorizer, where any peer is trusted (local experiments only)")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="multiaddrs of nodes already in the run")
    p.add_argument("--host-maddrs", nargs="+", metavar="MADDR", help="listen addresses (default 127.0.0.1 only)")
    p.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", help="addresses to advertise to peers")
    p.add_argument("--identity", metavar="PATH", help="libp2p key file; created if missing; keeps the peer id")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="compute device of a worker")
    p.add_argument("--max-batch", type=int, help="largest coalesced batch of a worker")
    p.add_argument("--dry-run", action="store_true", default=None, help="print the memory plan and exit")
    p.add_argument("--lanes", type=int, help="samples a trainer keeps in flight")
    p.add_argument("--data", help="'synthetic' or a path to .txt/.jsonl files")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizers JSON file (default: bytes)")
    p.add_argument("--max-samples", type=int, help="trainer stops after this many samples")
    p.add_argument("--shard-index", type=int, help="this trainer's data shard")
    p.add_argument("--num-shards", type=int, help="number of trainers sharing the data")
    p.add_argument("--bootstrap-timeout-s", type=float, help="seconds to try reaching the initial peers")
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads")
    p.add_argument("--discovery-period-s", type=float, help="trainer: seconds between worker discovery refreshes")
    p.add_argument("--announce-period-s", type=float, help="seconds between DHT re-announcements")
    p.add_argument("--revocation-refresh-s", type=float, help="seconds between revocation list refreshes")
    p.add_argument("--request-timeout-s", type=float, help="trainer: deadline of one request to a worker")
    p.add_argument("--reducer", action="store_true", default=None,
                   help="worker: reduce slices in averaging rounds (stable, well-connected nodes); otherwise only send")
    p.add_argument("--state-source", choices=["auto", "peers", "checkpoint", "none"],
                   help="worker joining a running stage: load its parameters from peers, a checkpoint, or not at all")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="worker: directory of stage checkpoints (read and written)")
    p.add_argument("--checkpoint-period-s", type=float,
                   help="worker: write a checkpoint to --checkpoint-dir at start and every this many seconds")
    p.add_argument("--test-init-seed-offset", type=int, help="TESTS ONLY: start a worker from other initial weights")
    p.add_argument("--test-averaging-stall-s", type=float,
                   help="TESTS ONLY: stall mid-round in every all-reduce for this long (fault injection)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "demo":
            from node.demo import demo_main

            return demo_main(argv[1:])
        if _role_of(argv) == "authorizer":
            return _run_authorizer(argv)
        return _run(argv)
    except ConfigError as exc:
        print(f"agora-node: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except AgoraError as exc:
        code = getattr(exc, "exit_code", None)
        if code is None:
            raise
        print(f"agora-node: error: {exc}", file=sys.stderr, flush=True)
        return code
    except KeyboardInterrupt:
        return 130


def _role_of(argv: list[str]) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg == "--role" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--role="):
            return arg.split("=", 1)[1]
    return None


def _run_authorizer(argv: list[str]) -> int:
    """`agora-node --role authorizer ...` is the authorizer service; `--config` names its run config."""
    from authorizer.main import main as authorizer_main

    translated: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--role":
            skip = True
        elif arg.startswith("--role="):
            continue
        elif arg == "--config":
            translated.append("--run-config")
        elif arg.startswith("--config="):
            translated.append("--run-config=" + arg.split("=", 1)[1])
        else:
            translated.append(arg)
    return authorizer_main(translated)


def _run(argv: list[str]) -> int:
    args = vars(node_parser().parse_args(argv))  # before the heavy imports: bad flags fail fast
    from node.settings import build_settings

    settings = build_settings(args)
    from node.daemon import configure_logging, run_node

    configure_logging(settings.log_level)
    return run_node(settings)


if __name__ == "__main__":
    sys.exit(main())
