"""Worker-to-worker routing against the trainer-driven path on WAN links, in the network lab.

Plays scenarios/bench-routing.yaml (a 4-stage tiny model, one worker per stage, every host
behind a shaped link) once per routing path and link RTT, on real agora-node processes in
network namespaces (node/netlab/), and prints ONE JSON object on stdout (logs on stderr): per
point, tokens/s after the warm-up on each path, their ratio, and every sample's accounting.
Needs root, like scripts/netlab. `--quick`: one RTT, 30 s runs.

A sample crosses 2S-1 round trips when the trainer calls each stage and S worker to worker, so
with few lanes the ratio approaches (2S-1)/S = 1.75 as the RTT grows; on 127.0.0.1
(scripts/bench_pipeline.py) there is no latency to save and the workers' extra calls cost CPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _bench_common import emit_report, log, machine_info  # noqa: E402

SCENARIO = ROOT / "scenarios" / "bench-routing.yaml"
PATHS = ("trainer", "workers")


def play(path: str, host_rtt_ms: float, duration_s: float, out_dir: Path) -> dict[str, Any]:
    from node.netlab.scenario import ScenarioRunner, load_scenario

    overrides = {"run.overrides.routing.path": path, "links.worker.rtt_ms": host_rtt_ms / 2,
                 "links.trainer.rtt_ms": host_rtt_ms / 2, "duration_s": duration_s}
    scenario, base = load_scenario(str(SCENARIO), overrides)
    started = time.monotonic()
    result = ScenarioRunner(scenario, base, str(out_dir), say=lambda line: log(f"  {line}")).run()
    accounting = result["accounting"]
    return {"tokens_per_s": result.get("tokens_per_s"), "samples_completed": accounting["samples_completed"],
            "samples_dropped": accounting["samples_dropped"], "unaccounted": accounting["unaccounted"],
            "cpu_percent": result.get("cpu_percent"), "wall_s": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 40.0, 100.0],
                   help="host-to-host round-trip times to measure (default 0 40 100)")
    p.add_argument("--duration-s", type=float, default=60.0, help="seconds per run, warm-up (15 s) included")
    p.add_argument("--quick", action="store_true", help="one RTT (40 ms), 30 s runs")
    p.add_argument("--out", metavar="PATH", help="also write the JSON result to PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.rtt_ms, args.duration_s = [40.0], 30.0
    workdir = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    points, errors = [], []
    for rtt in args.rtt_ms:
        point: dict[str, Any] = {"host_rtt_ms": rtt}
        for path in PATHS:
            log(f"RTT {rtt:g} ms, routing.path {path}")
            try:
                point[path] = play(path, rtt, args.duration_s, workdir / f"rtt{rtt:g}-{path}")
            except Exception as exc:  # noqa: BLE001 - report what was measured, and the failure
                errors.append(f"RTT {rtt:g} ms, {path}: {type(exc).__name__}: {exc}")
        if all(isinstance(point.get(path), dict) and point[path]["tokens_per_s"] for path in PATHS):
            point["workers_vs_trainer"] = round(point["workers"]["tokens_per_s"] / point["trainer"]["tokens_per_s"], 3)
        points.append(point)
    out = {"benchmark": "routing", "machine": machine_info(), "scenario": str(SCENARIO.relative_to(ROOT)),
           "method": ("scenarios/bench-routing.yaml played once per path and RTT: 4 stages x 1 worker, 1 trainer x 4 "
                      "lanes, every host's link 100 Mbit/s with half the RTT to the lab's switch; tokens/s from the "
                      "trainer's metrics after the 15 s warm-up; logs of every run under " + str(workdir)),
           "points": points, "errors": errors}
    emit_report(out, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
