"""`agora-node plan`: the bandwidth floor of each stage of a run [report 3.5.2.1].

Prints, per stage, the activation traffic of the report's formula (32 bits x (a_f + a_b) x
seq_len x k, per direction), the averaging burst under BF16 and FP32 (AR_payload values within
--ar-time-s) and their totals, the wire bytes per sample and per averaging round that a lab can
compare with what it measures, and a line comparing the body stages with the report's ~113/186
Mbit/s. The numbers come from `roles/model/traffic_plan.py`; a surrogate run plans like the run it
mirrors. `--json` prints the plan as one JSON object. Bad input is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from node.flags import OneLineErrorParser
from protocol.errors import ConfigError
from protocol.exit_codes import ExitCode

PROG = "agora-node plan"

USAGE = "\n  agora-node plan --config PRESET|PATH [--stage N] [--json] [--a-f 3] [--a-b 3] [--ar-time-s 10]"


def plan_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog=PROG, usage=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The bandwidth a node of each stage must sustain [report 3.5.2.1]: forward and backward\n"
                    "activations (k subspace coordinates per token, float32) plus one averaging round's burst.",
        epilog="exit codes: 0 printed; 2 bad flags or config.",
    )
    p.add_argument("--config", required=True, metavar="PRESET|PATH", help="the run's config: a preset or a YAML file")
    p.add_argument("--stage", type=int, metavar="N", help="only this stage (default: every stage)")
    p.add_argument("--a-f", type=float, default=3.0, metavar="N", help="forward samples a second per node (default 3)")
    p.add_argument("--a-b", type=float, default=3.0, metavar="N", help="backward samples a second per node (default 3)")
    p.add_argument("--ar-time-s", type=float, default=10.0, metavar="S",
                   help="seconds one averaging round may take (default 10)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return p


def _plan(args: argparse.Namespace):
    from protocol.run_config import load_run_config
    from roles.model.traffic_plan import plan_traffic

    for flag, value in (("--a-f", args.a_f), ("--a-b", args.a_b)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{flag} must be a non-negative number of samples per second, got {value}")
    if not (math.isfinite(args.ar_time_s) and args.ar_time_s > 0):
        raise ConfigError(f"--ar-time-s must be a positive number of seconds, got {args.ar_time_s}")
    run = load_run_config(args.config)
    stages = None if args.stage is None else [args.stage]
    return plan_traffic(run, a_f=args.a_f, a_b=args.a_b, ar_time_s=args.ar_time_s, stages=stages)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _comparison(plan) -> str:
    from roles.model.traffic_plan import REPORT_BODY_MBPS

    bodies = [s for s in plan.stages if s.kind == "body"]
    if not bodies:
        return "no body stage in this plan to compare with the report's ~113 / ~186 Mbit/s (8B body, BF16 / FP32)"
    bf16 = [s.total_mbps_bf16 for s in bodies]
    fp32 = [s.total_mbps_fp32 for s in bodies]

    def span(values: list[float]) -> str:
        low, high = min(values), max(values)
        return f"{low:.0f}" if round(low) == round(high) else f"{low:.0f}-{high:.0f}"

    return (f"body stages: {span(bf16)} Mbit/s (BF16), {span(fp32)} Mbit/s (FP32); the report's Pluralis-8B body "
            f"stage: ~{REPORT_BODY_MBPS['bf16']:.0f} / ~{REPORT_BODY_MBPS['fp32']:.0f} Mbit/s "
            f"at a_f = a_b = 3, AR_time = 10 s")


def render(plan) -> object:
    """The plan as a rich renderable: a table and the comparison line."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    title = f"{plan.run_id}" + (f" (surrogate of {plan.mirrors})" if plan.mirrors else "")
    table = Table(title=f"bandwidth plan: {title}", title_justify="left")
    names = ("stage", "kind", "activations Mbit/s", "averaging Mbit/s bf16 / fp32", "total Mbit/s bf16 / fp32",
             "bytes/sample", "values/round", "round fp32", "gradients Mbit/s")
    rows = [(str(s.stage), s.kind, f"{s.activation_mbps:.1f}",
             f"{s.averaging_mbps_bf16:.1f} / {s.averaging_mbps_fp32:.1f}",
             f"{s.total_mbps_bf16:.1f} / {s.total_mbps_fp32:.1f}",
             _mb(s.sample_bytes), f"{s.round_values / 1e6:.2f}M", _mb(s.round_bytes(4)),
             f"{s.gradient_mbps:.1f} ({'every step' if s.gradients_every_step else 'off'})") for s in plan.stages]
    for i, name in enumerate(names):
        # Headers may wrap, values never do (people and scripts grep "110.9 / 181.7").
        table.add_column(name, justify="left" if name in ("stage", "kind") else "right",
                         min_width=max(len(row[i]) for row in rows))
    for row in rows:
        table.add_row(*row)
    note = Text(f"a_f = {plan.a_f:g}, a_b = {plan.a_b:g} samples/s, one round in {plan.ar_time_s:g} s; "
                f"seq_len {plan.seq_len} x k {plan.subspace_rank} per boundary tensor, averaging.segments "
                f"{plan.segments}; gradients: what two replicas' per-step exchange needs, and whether the "
                f"run does it (averaging.gradients)")
    return Group(table, note, Text(_comparison(plan)))


def plan_main(argv: list[str]) -> int:
    """`agora-node plan ...`; returns the exit code, printing one line on bad input."""
    try:
        args = plan_parser().parse_args(argv)
        plan = _plan(args)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return ExitCode.USAGE
    if args.json:
        print(json.dumps(plan.to_dict()), flush=True)
        return ExitCode.OK
    from rich.console import Console

    console = Console(soft_wrap=False)
    renderable = render(plan)
    table_width = console.measure(renderable.renderables[0], options=console.options.update(max_width=400)).maximum  # as wide as the table needs
    Console(width=max(120, console.width, table_width), soft_wrap=False).print(renderable)
    return ExitCode.OK
