"""`scripts/netlab`: the network lab from the command line.

    netlab probe --rtt-ms 40 --mbit 200 [--seconds 3]   two hosts, measure both ways, print JSON
    netlab up TOPOLOGY.yaml                             hold a lab open until Ctrl-C
    netlab down                                         remove dead labs' leftovers (cleanup_stale)
    netlab run SCENARIO.yaml [--out DIR] [--set K=V]    play a scenario on real nodes, print its result

Each subcommand is one `_add_<name>(subparsers)` function that registers its parser and handler;
a new subcommand (the scenario runner's `run`) adds its own function to SUBCOMMANDS.
SIGINT/SIGTERM end any subcommand through the Lab's context manager, so the lab is torn down.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any, Callable

from node.netlab.cleanup import cleanup_stale
from node.netlab.errors import LabError
from node.netlab.plan import CONTROLLER, PREFIX, HostSpec


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; unwinding tears the lab down."""


def _raise_interrupted(signum, frame) -> None:
    # ignore further signals while the lab tears down: a second Ctrl-C must not cut stop() short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def _probe(args: argparse.Namespace) -> int:
    from node.netlab.topology import Lab

    shaped = HostSpec("a", up_mbit=args.mbit, down_mbit=args.mbit, rtt_ms=args.rtt_ms)
    with Lab([shaped, HostSpec("b")], subnet=args.subnet) as lab:
        result = {"upload a->b": lab.measure("a", "b", seconds=args.seconds),
                  "download b->a": lab.measure("b", "a", seconds=args.seconds)}
    print(json.dumps(result, indent=1))
    return 0


def _add_probe(sub) -> None:
    p = sub.add_parser("probe", help="build a two-host lab (one shaped host, one unshaped), measure, tear down")
    p.add_argument("--rtt-ms", type=float, default=40.0, help="RTT of the shaped host to the unshaped one")
    p.add_argument("--mbit", type=float, default=None, help="upload and download rate of the shaped host "
                                                           "(default: unshaped)")
    p.add_argument("--seconds", type=float, default=3.0, help="bulk transfer time per direction")
    p.add_argument("--subnet", default="10.77.0.0/16")
    p.set_defaults(func=_probe)


def load_topology(path: str) -> dict[str, Any]:
    """A topology file: `subnet:` (optional) and `hosts:`, a list of HostSpec fields."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    try:
        hosts = [HostSpec(**h) for h in data["hosts"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise LabError(f"{path}: a topology is `hosts:` (a list of name, up_mbit, down_mbit, rtt_ms) and an "
                       f"optional `subnet:`; {exc}") from exc
    return {"hosts": hosts, "subnet": data.get("subnet", "10.77.0.0/16")}


def _up(args: argparse.Namespace) -> int:
    from node.netlab.topology import Lab

    topology = load_topology(args.topology)
    with Lab(topology["hosts"], subnet=topology["subnet"]) as lab:
        rows = [{"host": CONTROLLER, "address": lab.address(CONTROLLER), "prefix": ""}]
        rows += [{"host": h.name, "address": lab.address(h.name), "prefix": " ".join(lab.command(h.name, [])),
                  "up_mbit": h.up_mbit, "down_mbit": h.down_mbit, "rtt_ms": h.rtt_ms} for h in topology["hosts"]]
        for row in rows:
            print(f"{row['host']:<16} {row['address']:<15} {row['prefix']}")
        print("NETLAB-READY " + json.dumps({"lab_id": lab.lab_id, "hosts": rows}), flush=True)
        threading.Event().wait()  # until SIGINT/SIGTERM raises Interrupted
    return 0


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="hold the lab of TOPOLOGY.yaml open until Ctrl-C")
    p.add_argument("topology", help="YAML: hosts: [{name, up_mbit, down_mbit, rtt_ms}], subnet: (optional)")
    p.set_defaults(func=_up)


def _down(args: argparse.Namespace) -> int:
    from node.netlab.natlab import PREFIX as NAT_LAB_PREFIX

    prefixes = [args.prefix] if args.prefix else [PREFIX, NAT_LAB_PREFIX]
    removed = [line for prefix in prefixes for line in cleanup_stale(prefix)]
    for line in removed:
        print(line)
    print(f"removed {len(removed)} leftover(s) of dead labs", file=sys.stderr)
    return 0


def _add_down(sub) -> None:
    p = sub.add_parser("down", help="remove the leftovers of labs whose controller died")
    p.add_argument("--prefix", default=None, help="only labs of this prefix (default: the TUN lab's and the NAT lab's)")
    p.set_defaults(func=_down)


def _run_scenario(args: argparse.Namespace) -> int:
    import time

    import yaml

    from node.netlab.scenario import ScenarioRunner, load_scenario
    from protocol.errors import ConfigError

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"netlab: --set {item}: expected KEY=VALUE (e.g. duration_s=120)", file=sys.stderr)
            return 2
        overrides[key] = yaml.safe_load(value)
    try:
        scenario, base = load_scenario(args.scenario, overrides)
    except ConfigError as exc:
        print(f"netlab: {exc}", file=sys.stderr)
        return 2
    out = args.out or f"/tmp/netlab-{scenario.name}-{int(time.time())}"
    try:
        result = ScenarioRunner(scenario, base, out).run()
    except ConfigError as exc:  # e.g. --out names a directory of someone else's files
        print(f"netlab: {exc}", file=sys.stderr)
        return 2
    brief = {k: result.get(k) for k in ("scenario", "links", "tokens_per_s", "accounting", "restarts", "deaths",
                                        "cpu_percent")}
    brief["averaging"] = {k: v for k, v in result["averaging"].items() if k != "detail"}
    brief["result"] = f"{out}/result.json"
    print(json.dumps(brief, indent=1, default=str))
    return 0


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="play a scenario (scenarios/*.yaml) on real agora-node processes in a lab")
    p.add_argument("scenario", help="scenario YAML file")
    p.add_argument("--out", default=None, help="directory for logs and result.json (default: /tmp/netlab-NAME-TIME)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario field (dotted keys address nested ones: links.contributor.rtt_ms=80)")
    p.set_defaults(func=_run_scenario)


SUBCOMMANDS: list[Callable[[Any], None]] = [_add_probe, _add_up, _add_down, _add_run]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="netlab", description="the agora-node network lab (needs root and /dev/net/tun)")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGINT, _raise_interrupted)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        return args.func(args)
    except Interrupted as exc:
        print(f"netlab: {exc}, lab torn down", file=sys.stderr)
        return 130
    except LabError as exc:
        print(f"netlab: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
