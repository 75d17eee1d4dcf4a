"""The staleness frontier: tokens/s and the fidelity gap together, over the
head's forward gate (`staleness.max_delayed_per_step`) and the batch size, on both routing paths.
Prints ONE JSON object on stdout (progress to stderr); `--out PATH` also writes it.

Each point is one `scripts/bench_fidelity.py` run (the tiny preset, 3 stages x 1 worker, 2
trainers) in a child process, so a point's figures are exactly what that bench reports:
- `held_out_gap`: the swarm's held-out loss against one process trained on the swarm's own steps
  (`gaps.held_out`); `staleness_alone` the same for a replay at the swarm's weight versions.
- `tokens_per_s`: samples x seq_len over the trainers' wall time (`swarm.train_tokens_per_s`, start
  and drain included). Points of one batch size run back to back, alternating the gates' order on
  each repeat, and `vs_gate_0` divides by the gate-0 point of the same batch, path and repeat.
- `delayed_share`: of the head's gradients, the share taken on weights older than the step they
  joined (the staleness the gate bounds).

Gates are fractions of the batch (`--gates 0,1/16,1/8,none`: 0, 1 and 2 samples at batch 16), so
one grid reads across batch sizes; `none` is no gate. Lanes per trainer grow with the batch
(`max(4, batch/8)`), or `--lanes N`: with too few samples in flight a gate cannot bind.
Each point takes 1-2 minutes on the 2-core development machine (batch 512 at 20 steps: about 2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import emit_report, log, machine_info  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTING_OF_BATCH = {16: "demo", 64: "batch64", 512: "batch512"}


def parse_gate(text: str) -> Optional[Fraction]:
    """'none' (no gate) or a fraction of the batch, '0', '1/8' or '0.125'."""
    if text.strip().lower() == "none":
        return None
    value = Fraction(text.strip())
    if value < 0:
        raise argparse.ArgumentTypeError(f"a gate is a fraction of the batch >= 0, not {text}")
    return value


def gate_samples(fraction: Optional[Fraction], batch: int) -> Optional[int]:
    return None if fraction is None else int(fraction * batch)


def run_point(batch: int, gate: Optional[int], path: str, lanes: int, steps: Optional[int],
              noise_runs: int) -> dict[str, Any]:
    """One bench_fidelity run; its figures of interest, or its error."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out_path = handle.name
    command = [sys.executable, os.path.join(ROOT, "scripts", "bench_fidelity.py"), "--setting",
               SETTING_OF_BATCH[batch], "--routing", path, "--lanes", str(lanes), "--noise-runs", str(noise_runs),
               "--out", out_path]
    command += ["--no-forward-gate"] if gate is None else ["--max-delayed-per-step", str(gate)]
    if steps is not None:
        command += ["--steps", str(steps)]
    point: dict[str, Any] = {"batch": batch, "gate": gate, "path": path, "lanes_per_trainer": lanes}
    started = time.monotonic()
    try:
        finished = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  timeout=1800)
        with open(out_path) as handle:
            report = json.load(handle)
    except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
        point["error"] = f"{type(exc).__name__}: {exc}"
        return point
    finally:
        if os.path.exists(out_path):
            os.unlink(out_path)
    result = report["settings"][SETTING_OF_BATCH[batch]]
    swarm, gaps = result.get("swarm", {}), result.get("gaps", {})
    head = (swarm.get("per_stage", {}).get("0") or {}).get("replicas") or []
    staleness = head[0].get("staleness") if head else None
    point.update({
        "tokens_per_s": swarm.get("train_tokens_per_s"),
        "held_out_gap": gaps.get("held_out"),
        "staleness_alone": gaps.get("staleness_alone_held_out"),
        "held_out_vs_replay": gaps.get("held_out_vs_replay"),
        "order_noise_relative_std": (result.get("reference", {}).get("order_noise") or {}).get("relative_std"),
        "delayed_share_head": (staleness or {}).get("delayed_share"),
        "accounting": {k: (swarm.get("accounting") or {}).get(k) for k in ("completed", "dropped", "unaccounted")},
        "steps": result.get("config", {}).get("steps"),
        "wall_s": round(time.monotonic() - started, 1),
        "errors": report.get("errors", []) + ([] if finished.returncode == 0 else [f"exit {finished.returncode}"]),
    })
    return point


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="16,64,512", help="target batch sizes, of 16, 64, 512 (default all three)")
    p.add_argument("--gates", default="0,1/16,1/8,none", help="gates as fractions of the batch, or none")
    p.add_argument("--paths", default="trainer,workers", help="routing paths (default both)")
    p.add_argument("--lanes", type=int, metavar="N", help="lanes per trainer (default max(4, batch/8))")
    p.add_argument("--steps-512", type=int, default=20, metavar="N", help="steps at batch 512 (default 20)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every point (default 1)")
    p.add_argument("--out", metavar="PATH", help="also write the JSON result to PATH")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        gates = [parse_gate(g) for g in args.gates.split(",")]
    except (ValueError, ZeroDivisionError, argparse.ArgumentTypeError) as exc:
        p.error(f"--batches/--gates: {exc}")
    if any(b not in SETTING_OF_BATCH for b in batches):
        p.error(f"--batches: each of {', '.join(map(str, SETTING_OF_BATCH))}")
    paths = args.paths.split(",")
    if any(path not in ("trainer", "workers") for path in paths):
        p.error("--paths: trainer and/or workers")

    started = time.monotonic()
    points: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for batch in batches:
            order = gates if repeat % 2 == 0 else list(reversed(gates))
            lanes = args.lanes or max(4, batch // 8)
            for path in paths:
                for fraction in order:
                    gate = gate_samples(fraction, batch)
                    if any(q["batch"] == batch and q["gate"] == gate and q["path"] == path and q["repeat"] == repeat
                           for q in points):
                        continue  # two fractions that round to one gate
                    log(f"[{time.monotonic() - started:6.0f}s] batch {batch}, gate {gate}, {path} path, "
                        f"{lanes} lanes x 2 trainers")
                    point = run_point(batch, gate, path, lanes, args.steps_512 if batch == 512 else None,
                                      0 if batch == 512 else 3)
                    point["repeat"] = repeat
                    log(f"    {json.dumps({k: point.get(k) for k in ('tokens_per_s', 'held_out_gap', 'delayed_share_head', 'errors')})}")
                    points.append(point)
    for point in points:
        base = next((q for q in points if q["batch"] == point["batch"] and q["path"] == point["path"]
                     and q["repeat"] == point["repeat"] and q["gate"] == 0 and q.get("tokens_per_s")), None)
        point["vs_gate_0"] = (round(point["tokens_per_s"] / base["tokens_per_s"], 3)
                              if base and point.get("tokens_per_s") else None)
    errors = [f"batch {q['batch']} gate {q['gate']} {q['path']}: {e}" for q in points
              for e in ([q["error"]] if "error" in q else q.get("errors", []))]
    out = {"benchmark": "frontier", "machine": machine_info(), "points": points, "errors": errors,
           "elapsed_s": round(time.monotonic() - started, 1),
           "how_to_read": "one bench_fidelity run per point (module docstring); gate: staleness.max_delayed_per_step "
                          "(null: no gate); vs_gate_0: tokens/s over the gate-0 point of the same batch, path and "
                          "repeat; held_out_gap: (swarm - one process on the swarm's steps) / one process"}
    emit_report(out, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
