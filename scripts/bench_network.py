"""The report's §3.5 figures for our swarm, measured in the network lab (scripts/netlab).

Runs real agora-node processes in network namespaces behind shaped links (node/netlab/) on
surrogate stages that move an 8B run's bytes, and prints ONE JSON object on stdout (logs go to
stderr); `--out DIR` also writes `bench_network.json` and the PNG plots there.

Three parts, each a scenario file in scenarios/ played with overrides:

`grid` (§3.5.2)
    scenarios/bench-grid.yaml with the contributors' link set to RTT {0, 20, ..., 120} ms at
    200 Mbit/s, then 50 and 100 Mbit/s at 100 ms. Per point: trainer tokens/s after warm-up,
    averaging round duration, completeness (share of reduced chunks a worker got back, as the
    report counts it) and failed rounds (completeness below 100%), and each host's bytes against
    the bandwidth plan (`agora-node plan`).
`preempt` (§3.5.3)
    scenarios/bench-preempt.yaml with contributors of a stage preempted by operator orders while
    they send their chunks, and reducers preempted while sending chunks and while sending reduced
    chunks back: completeness seen by the survivors in the round it happened and the rounds after.
`sparseloco`
    bench-grid with SparseLoCo in place of AsyncSPARTA (H 6; 1,280 of 4,096 of the surrogate's
    5% vector kept, which is SparseLoCo's default density of the real 8B body stage) and the same
    points with AsyncSPARTA, contributors at 200 and 50 Mbit/s, 80 ms: rounds by outcome, bytes
    each body replica sent per step, and the compute thread's wait per round (the critical path).
`churn`
    scenarios/bench-churn.yaml for `--churn-s` seconds without churn, then with 25% of the workers
    SIGKILLed every 30 s and restarted with the same identity: tokens/s retained, samples
    unaccounted, seconds from restart to serving.

The topology is scaled to what the machine carries; the scenario files say what it is, the JSON
repeats it with the CPU each node used. `--quick` runs one grid point, one preemption case and a
short churn.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _bench_common import log, machine_info  # noqa: E402

SCENARIOS = ROOT / "scenarios"
GRID = [(rtt, 200) for rtt in (0, 20, 40, 60, 80, 100, 120)] + [(100, 100), (100, 50)]
REPORT = {
    "source": "Agora technical report §3.5.2.3 and §3.5.3 (figures 8-10), read off the text",
    "failed_rounds_pct_at_200mbit_up_to_80ms": "< 15",
    "completeness_pct": "~100 under all grid conditions",
    "round_duration_at_120ms_vs_0ms": "> 2.5x",
    "preemption_completeness_pct": "> 90, next rounds equally stable",
    "bandwidth_floor_mbit": {"bf16": 113, "fp32": 186},
}


def plan_summary() -> dict[str, Any]:
    """`agora-node plan` for 8b and surrogate-8b: the four-block body stage against the report."""
    from protocol.run_config import load_run_config
    from roles.model.traffic_plan import plan_traffic

    out = {}
    for preset in ("8b", "surrogate-8b"):
        body = plan_traffic(load_run_config(preset)).stage(1)
        out[preset] = {"body_stage": 1, "activation_mbit": round(body.activation_mbps, 1),
                       "bf16_mbit": round(body.total_mbps_bf16, 1), "fp32_mbit": round(body.total_mbps_fp32, 1),
                       "round_values": body.round_values, "sample_bytes": body.sample_bytes}
    out["report"] = REPORT["bandwidth_floor_mbit"]
    return out


REUSE = False
"""--reuse: a scenario whose directory already holds a result.json is re-read, not played again
(its tallies are recomputed from the nodes' summaries, so a change to the analysis applies)."""


def play(name: str, overrides: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    from node.netlab.scenario import ScenarioRunner, _accounting, _averaging, load_scenario
    from node.netlab.traffic_check import traffic_vs_plan

    saved = out_dir / "result.json"
    if REUSE and saved.exists():
        log(f"  reusing {saved}")
        result = json.loads(saved.read_text())
        result["accounting"] = _accounting(result["summaries"])
        result["averaging"] = _averaging(result["summaries"], result.get("deaths", []), result.get("stopped_at_unix"))
        result["traffic_vs_plan"] = traffic_vs_plan(result, str(out_dir / "run.yaml"))
        return result
    scenario, base = load_scenario(str(SCENARIOS / f"{name}.yaml"), overrides)
    started = time.monotonic()
    result = ScenarioRunner(scenario, base, str(out_dir), say=lambda line: log(f"  {line}")).run()
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    """What a figure needs of a scenario's result (the full result stays in its directory)."""
    averaging = result["averaging"]
    return {
        "tokens_per_s": result.get("tokens_per_s"),
        "rounds": averaging["rounds"],
        "failed_rounds_pct": averaging["failed_pct"],
        "completeness_pct": None if averaging["completeness_mean"] is None else round(100 * averaging["completeness_mean"], 2),
        "completeness_min_pct": None if averaging["completeness_min"] is None else round(100 * averaging["completeness_min"], 2),
        "completeness_all_rounds_pct": None if averaging["completeness_mean_all"] is None
        else round(100 * averaging["completeness_mean_all"], 2),
        "rounds_without_group": averaging["no_group"],
        "rounds_cut_by_stop": averaging.get("cut_by_stop", 0),
        "round_duration_mean_s": averaging["duration_mean_s"],
        "links": result.get("links"),
        "accounting": result["accounting"],
        "cpu_percent": result.get("cpu_percent"),
        "traffic": result.get("traffic"),
        "traffic_vs_plan": result.get("traffic_vs_plan"),
        "never_died": result.get("never_died"),
        "wall_s": result.get("wall_s"),
    }


def run_grid(out: Path, quick: bool) -> list[dict[str, Any]]:
    points = [(80, 200)] if quick else GRID
    rows = []
    for rtt, mbit in points:
        log(f"grid: contributors at {rtt} ms RTT, {mbit} Mbit/s")
        link = {"up_mbit": mbit, "down_mbit": mbit, "rtt_ms": rtt}
        result = play("bench-grid", {"links.contributor": link}, out / f"grid-{rtt}ms-{mbit}mbit")
        rows.append({"rtt_ms": rtt, "mbit": mbit, **_brief(result)})
    return rows


SPARSELOCO_POINTS = [(80, 200), (80, 50)]
SPARSELOCO_TOPK = 1280
"""The surrogate body stage averages a 44.2M-value vector: AsyncSPARTA's 5% round of the real 8B
four-block body (874M parameters). 1,280 of every 4,096 of it (31%) is as many kept values as 64 of
4,096 (SparseLoCo's default) of the whole real stage, so a SparseLoCo round moves the real stage's
bytes (about 31 MB per replica and cycle)."""


def _sparseloco_figures(result: dict[str, Any], stage: int = 1) -> dict[str, Any]:
    """What the body stage's replicas did with SparseLoCo, from their summaries: rounds by outcome,
    bytes each replica sent per stage step, and the time the compute thread waited per round."""
    rows = []
    for item in result.get("summaries", []):
        summary = item.get("summary") or {}
        slc = summary.get("sparseloco")
        if item.get("stage") != stage or not slc:
            continue
        steps = (summary.get("steps") or {}).get("taken") or summary.get("local_step") or 0
        rounds = slc.get("rounds") or {}
        ran = sum(rounds.values())
        rows.append({"node": item["name"], "steps": steps, "rounds": rounds,
                     "bytes_sent_per_step": round(slc["bytes_sent"] / steps) if steps else None,
                     "wait_s_per_round": round(slc["wait_s"] / ran, 3) if ran else None,
                     "wait_s_per_step": round(slc["wait_s"] / steps, 4) if steps else None})
    total = {k: sum((r["rounds"].get(k, 0) for r in rows)) for k in ("complete", "partial", "failed", "alone")}
    return {"replicas": rows, "rounds": total,
            "bytes_sent_per_step_mean": round(sum(r["bytes_sent_per_step"] or 0 for r in rows) / len(rows)) if rows else None,
            "wait_s_per_round_mean": (round(sum(r["wait_s_per_round"] or 0 for r in rows) / len(rows), 3)
                                      if rows else None)}


def _tx_per_step(result: dict[str, Any], stage: int = 1) -> dict[str, Any]:
    """Bytes each body worker's host sent per stage step, as the lab's link counted them
    (pipeline and averaging together; stage 0's lone worker shows the pipeline's share)."""
    steps = {i["name"]: ((i.get("summary") or {}).get("steps") or {}).get("taken") for i in result.get("summaries", [])}
    stages = {i["name"]: i.get("stage") for i in result.get("summaries", [])}
    traffic = result.get("traffic") or {}
    return {name: round(t["tx_bytes"] / steps[name]) for name, t in traffic.items()
            if steps.get(name) and stages.get(name) in (0, stage)}


def run_sparseloco(out: Path, quick: bool) -> list[dict[str, Any]]:
    """The grid's scenario at 200 and 50 Mbit/s (80 ms) with SparseLoCo (H 6, as the grid averages
    every 6 steps) in place of AsyncSPARTA, streamed (two fragments, each applied two steps after
    its capture), and the same points with AsyncSPARTA for comparison."""
    points = SPARSELOCO_POINTS[:1] if quick else SPARSELOCO_POINTS
    rows = []
    for rtt, mbit in points:
        link = {"up_mbit": mbit, "down_mbit": mbit, "rtt_ms": rtt}
        for method in ("sparseloco", "sparseloco-streamed", "asyncsparta"):
            log(f"sparseloco part: {method}, contributors at {rtt} ms RTT, {mbit} Mbit/s")
            overrides: dict[str, Any] = {"links.contributor": link}
            if method.startswith("sparseloco"):
                settings = {"inner_steps": 6, "topk_per_chunk": SPARSELOCO_TOPK, "round_timeout_s": 60.0}
                if method == "sparseloco-streamed":  # two halves, each applied two steps after its capture
                    settings.update(fragments=2, overlap_steps=2)
                overrides["run.overrides.averaging"] = {"method": "sparseloco", "sparseloco": settings}
            result = play("bench-grid", overrides, out / f"sparseloco-{method}-{rtt}ms-{mbit}mbit")
            row = {"method": method, "rtt_ms": rtt, "mbit": mbit, **_brief(result)}
            row["tx_bytes_per_step"] = _tx_per_step(result)
            if method.startswith("sparseloco"):
                row["sparseloco"] = _sparseloco_figures(result)
            rows.append(row)
    return rows


PREEMPT_CASES = {
    "1 contributor, chunk send": {"preempt": ["c1a"], "moment": "chunk_send"},
    "3 contributors, chunk send": {"preempt": ["c1a", "c1b", "c1c"], "moment": "chunk_send"},
    "5 contributors, chunk send": {"preempt": ["c1a", "c1b", "c1c", "c1d", "c1e"], "moment": "chunk_send"},
    "3 contributors over two stages, chunk send": {"preempt": ["c1a", "c1b", "c2a"], "moment": "chunk_send"},
    "reducers, chunk send": {"preempt": ["r1b"], "moment": "chunk_send"},
    "reducers, reduced-chunk send": {"preempt": ["r1b"], "moment": "reduced_send"},
}


def run_preempt(out: Path, quick: bool, at_s: float, only_cases: str = "") -> list[dict[str, Any]]:
    cases = dict(list(PREEMPT_CASES.items())[:1]) if quick else PREEMPT_CASES
    if only_cases:  # indices into PREEMPT_CASES, e.g. "2,5"
        labels = list(PREEMPT_CASES)
        cases = {labels[int(i) - 1]: PREEMPT_CASES[labels[int(i) - 1]] for i in only_cases.split(",")}
    rows = []
    for label, event in cases.items():
        log(f"preempt: {label}")
        slug = label.replace(" ", "-").replace(",", "")
        result = play("bench-preempt", {"events": [{"at_s": at_s, **event}]}, out / f"preempt-{slug}")
        preempted = set(event["preempt"])
        deaths = [d for d in result["deaths"] if d["node"] in preempted]
        died_at = min((d["t_s"] for d in deaths), default=at_s)
        rows.append({"case": label, "preempted": sorted(preempted), "died": deaths,
                     "survivors": _rounds_around(result, died_at), **_brief(result)})
    return rows


def _rounds_around(result: dict[str, Any], at_s: float) -> dict[str, Any]:
    """Completeness the survivors saw in the first round that ended after the first victim died
    (`at_s` after the trainers started), and in the rounds after it."""
    start = result.get("started_at_unix")
    rounds = sorted(result["averaging"]["detail"], key=lambda r: r.get("finished_at") or 0)
    if start is None:
        return {"note": "no start time"}
    after = [r for r in rounds if (r.get("finished_at") or 0) - start >= at_s]
    by_node: dict[str, list] = {}
    for r in after:
        by_node.setdefault(r["node"], []).append(r)
    first = [rs[0] for rs in by_node.values() if rs]
    following = [rs[1] for rs in by_node.values() if len(rs) > 1]
    later = [r for rs in by_node.values() for r in rs[1:]]

    def mean(rows, key="averaging_success"):
        values = [r.get(key, r["averaging_success"]) or 0.0 for r in rows]
        return round(100 * sum(values) / len(values), 2) if values else None

    return {"round_of_preemption_completeness_pct": mean(first),
            "round_of_preemption_completeness_before_repair_pct": mean(first, "averaging_success_before_repair"),
            "round_of_preemption_repaired": sum(1 for r in first if r.get("repair_status")),
            "next_round_completeness_pct": mean(following),
            "next_round_all_chunks_back": sum(1 for r in following if (r["averaging_success"] or 0) >= 1.0),
            "next_round_survivors": len(following),
            "next_rounds_completeness_pct": mean(later),
            "next_rounds": len(later), "next_rounds_complete": sum(1 for r in later if r["status"] == "complete")}


def run_churn(out: Path, quick: bool, seconds: float) -> dict[str, Any]:
    seconds = 90 if quick else seconds
    log(f"churn: baseline {seconds:.0f}s without churn")
    calm = play("bench-churn", {"duration_s": seconds, "churn": None}, out / "churn-off")
    log(f"churn: {seconds:.0f}s with 25% of workers killed every 30 s")
    churn = play("bench-churn", {"duration_s": seconds}, out / "churn-on")
    ready = [r["ready_s"] for r in churn["restarts"] if r.get("ready_s") is not None]
    serving = [r["serving_s"] for r in churn["restarts"] if r.get("serving_s") is not None]
    return {
        "seconds": seconds,
        "tokens_per_s_without": calm["tokens_per_s"], "tokens_per_s_with": churn["tokens_per_s"],
        "retained": round(churn["tokens_per_s"] / calm["tokens_per_s"], 3) if calm["tokens_per_s"] else None,
        "kills": sum(1 for d in churn["deaths"] if d["how"] == "churn"),
        "restarts": len(churn["restarts"]),
        "restarts_failed": sum(1 for r in churn["restarts"] if r.get("ready_s") is None),
        "restart_to_ready_s_max": max(ready) if ready else None,
        "restart_to_serving_s_max": max(serving) if serving else None,
        "restart_to_serving_s": serving,
        "never_served_again": sum(1 for r in churn["restarts"] if r.get("serving_s") is None),
        "killed_again_before_serving": sum(1 for r in churn["restarts"] if r.get("killed_before_serving")),
        "accounting_without": calm["accounting"], "accounting_with": churn["accounting"],
        "cpu_percent": churn.get("cpu_percent"),
    }


def plot(report: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    grid = report.get("grid") or []
    if grid:
        at200 = [r for r in grid if r["mbit"] == 200]
        low = [r for r in grid if r["mbit"] != 200]
        fig, axes = plt.subplots(1, 4, figsize=(18, 4))
        for ax, key, title in zip(axes, ("tokens_per_s", "round_duration_mean_s", "completeness_pct", "failed_rounds_pct"),
                                  ("tokens/s", "averaging round (s)", "completeness (%)", "failed rounds (%)")):
            ax.plot([r["rtt_ms"] for r in at200], [r[key] if r[key] is not None else float("nan") for r in at200],
                    "o-", label="200 Mbit/s")
            for r in low:
                ax.plot([r["rtt_ms"]], [r[key] if r[key] is not None else float("nan")], "s", label=f"{r['mbit']} Mbit/s")
            if key == "failed_rounds_pct":
                ax.axhline(15, color="grey", ls="--", lw=1, label="report: < 15% at 200 Mbit/s")
            if key == "completeness_pct":
                ax.axhline(99, color="grey", ls="--", lw=1, label="target 99%")
            ax.set_xlabel("contributor RTT (ms)")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[-1].legend(fontsize=7)
        fig.suptitle("Stability under bandwidth constraints (surrogate-8b traffic; report §3.5.2)")
        fig.tight_layout()
        path = out / "bench_network_grid.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    cases = report.get("preempt") or []
    if cases:
        fig, ax = plt.subplots(figsize=(10, 4))
        labels = [c["case"] for c in cases]
        first = [c["survivors"].get("round_of_preemption_completeness_pct") or 0 for c in cases]
        following = [c["survivors"].get("next_round_completeness_pct") or 0 for c in cases]
        later = [c["survivors"].get("next_rounds_completeness_pct") or 0 for c in cases]
        xs = range(len(labels))
        ax.bar([x - 0.27 for x in xs], first, width=0.27, label="round of the preemption")
        ax.bar(list(xs), following, width=0.27, label="next round")
        ax.bar([x + 0.27 for x in xs], later, width=0.27, label="all later rounds")
        ax.axhline(90, color="grey", ls="--", lw=1, label="target 90%")
        ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylim(0, 122)
        ax.set_ylabel("completeness seen by survivors (%)")
        ax.set_title("All-reduce fault tolerance (report §3.5.3)")
        ax.legend(fontsize=8, loc="upper center", ncol=4)
        fig.tight_layout()
        path = out / "bench_network_preempt.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for the JSON, the plots and every scenario's files")
    parser.add_argument("--only", default="grid,preempt,churn", help="comma-separated parts to run")
    parser.add_argument("--quick", action="store_true", help="one grid point, one preemption case, a short churn")
    parser.add_argument("--churn-s", type=float, default=300.0, help="seconds of each churn run (default 300)")
    parser.add_argument("--reuse", action="store_true",
                        help="re-read the scenarios already played in --out instead of playing them again")
    parser.add_argument("--preempt-at-s", type=float, default=40.0, help="when the preemption orders are sent")
    parser.add_argument("--cases", default="", help="preemption cases to play, by number (1-6), e.g. 2,5; default all")
    args = parser.parse_args()
    global REUSE
    REUSE = args.reuse

    def interrupted(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupted)  # the labs' context managers tear everything down
    if os.geteuid() != 0:
        print("bench_network: the network lab needs root (namespaces, TUN devices)", file=sys.stderr)
        return 2
    out = Path(args.out or f"/tmp/bench_network-{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(parts) - {"grid", "preempt", "churn", "sparseloco"}
    if unknown:
        print(f"bench_network: --only {','.join(sorted(unknown))}: parts are grid, preempt, churn, sparseloco",
              file=sys.stderr)
        return 2
    numbers = [n.strip() for n in args.cases.split(",") if n.strip()]
    if any(not n.isdigit() or not 1 <= int(n) <= len(PREEMPT_CASES) for n in numbers):
        print(f"bench_network: --cases {args.cases}: give case numbers 1-{len(PREEMPT_CASES)}, e.g. 2,5", file=sys.stderr)
        return 2
    args.cases = ",".join(numbers)
    report: dict[str, Any] = {"machine": machine_info(), "report": REPORT, "quick": args.quick}
    report["plan"] = plan_summary()
    started = time.monotonic()
    try:
        run_parts(parts, report, out, args)
    except KeyboardInterrupt:
        print("bench_network: interrupted; every lab torn down (partial results in "
              f"{out / 'bench_network.partial.json'})", file=sys.stderr)
        return 130
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["plots"] = plot(report, out)
    text = json.dumps(report, indent=1, default=str)
    (out / "bench_network.json").write_text(text)
    print(text)
    return 0


def run_parts(parts: list[str], report: dict[str, Any], out: Path, args: argparse.Namespace) -> None:
    for part in parts:  # in the order given
        if part == "grid":
            report["grid"] = run_grid(out, args.quick)
        elif part == "preempt":
            report["preempt"] = run_preempt(out, args.quick, args.preempt_at_s, args.cases)
        elif part == "sparseloco":
            report["sparseloco"] = run_sparseloco(out, args.quick)
        else:
            report["churn"] = run_churn(out, args.quick, args.churn_s)
        (out / "bench_network.partial.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
