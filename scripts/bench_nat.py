"""Contributors behind NAT against the same swarm all public, in the network lab.

Plays scenarios/nat.yaml twice on the same shaped links: as written (half of the body stage
behind home routers, one of them behind two levels of NAT, serving through the run's two relays,
one relay killed mid-run) and with every worker public (the relays still run; nobody needs them).
Prints ONE JSON object on stdout (logs on stderr); `--out DIR` also writes bench_nat.json there.

Per variant: trainer tokens/s after warm-up, the sample accounting (every sample started is
completed or dropped with a reason), the body stage's samples served by each worker, and the
averaging rounds. For the NAT variant also: bytes each relay carried (p2pd's
`libp2p_relaysvc_data_transferred_bytes_total`) and the CPU it spent per MB, the share of the
trainer's pipeline bytes that went through a relay, and the share of all bytes the lab moved that
were relayed. The comparison is the ratio of tokens/s, NAT over public.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _bench_common import log, machine_info  # noqa: E402

SCENARIO = ROOT / "scenarios" / "nat.yaml"


def _max_sample(result: dict[str, Any], node: str, prefix: str) -> float:
    """The largest value a counter starting with `prefix` reached on `node` over the scrapes."""
    best = 0.0
    for snapshot in result.get("scrapes", []):
        samples = snapshot.get("nodes", {}).get(node, {})
        best = max(best, sum(v for k, v in samples.items() if k.startswith(prefix)))
    return best


def play(overrides: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    from node.netlab.scenario import ScenarioRunner, load_scenario

    scenario, base = load_scenario(str(SCENARIO), overrides)
    started = time.monotonic()
    result = ScenarioRunner(scenario, base, str(out_dir), say=lambda line: log(f"  {line}")).run()
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def brief(result: dict[str, Any], relays: list[str], trainers: list[str]) -> dict[str, Any]:
    served: dict[str, int] = {}
    for item in result["summaries"]:
        if item["role"] == "trainer" and item["summary"]:
            for peer, count in (item["summary"].get("served") or {}).get("1", {}).items():
                served[peer] = served.get(peer, 0) + count
    names = {item.get("peer", ""): item["name"] for item in result["summaries"] if item["role"] == "worker"}
    out: dict[str, Any] = {
        "tokens_per_s": result.get("tokens_per_s"),
        "measured_s": result.get("measured_s"),
        "accounting": result["accounting"],
        "body_stage_served": {names.get(peer, peer): count for peer, count in served.items()},
        "averaging": {k: result["averaging"].get(k) for k in ("rounds", "failed_pct", "completeness_mean")},
        "cpu_percent": result.get("cpu_percent"),
        "wall_s": result.get("wall_s"),
    }
    relayed = {name: _max_sample(result, name, "libp2p_relaysvc_data_transferred_bytes_total") for name in relays}
    measured_s = max(result.get("measured_s") or 0.0, 1e-9)
    cpu_s = {name: (result.get("cpu_percent") or {}).get(name, 0.0) / 100 * measured_s for name in relays}
    out["relays"] = {name: {"relayed_mb": round(relayed[name] / 1e6, 2), "cpu_s": round(cpu_s[name], 2),
                            "cpu_ms_per_mb": round(1000 * cpu_s[name] / (relayed[name] / 1e6), 2)
                            if relayed[name] > 0 else None} for name in relays}
    pipeline = sum(_max_sample(result, name, "agora_bytes_sent_total{channel=\"pipeline\"")
                   + _max_sample(result, name, "agora_bytes_received_total{channel=\"pipeline\"") for name in trainers)
    through_relays = sum(_max_sample(result, name, "agora_relayed_bytes_total") for name in trainers)
    out["trainer_pipeline_bytes_relayed_fraction"] = round(through_relays / pipeline, 4) if pipeline else None
    moved = sum(host.get("tx_bytes", 0) for host in (result.get("traffic") or {}).values() if isinstance(host, dict))
    out["lab_bytes_relayed_fraction"] = round(sum(relayed.values()) * 2 / moved, 4) if moved else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="also write bench_nat.json into this directory")
    parser.add_argument("--work", default="/tmp/agora-bench-nat", help="the scenarios' working directories")
    parser.add_argument("--duration-s", type=float, default=None, help="override the scenario's duration")
    args = parser.parse_args()
    from node.netlab.scenario import load_scenario

    scenario, _ = load_scenario(str(SCENARIO))
    relays = [n.name for n in scenario.nodes if n.role == "relay"]
    trainers = [n.name for n in scenario.nodes if n.role == "trainer"]
    extra = {"duration_s": args.duration_s} if args.duration_s else {}
    public_nodes = [{**n.model_dump(exclude_none=True), "behind": None} for n in scenario.nodes]
    for node in public_nodes:
        node.pop("behind")
    work = Path(args.work)
    log("NAT variant (scenarios/nat.yaml as written)")
    nat = play(extra, work / "nat")
    log("public variant (every worker public, same links)")
    public = play({**extra, "nodes": public_nodes, "routers": []}, work / "public")
    result = {"bench": "nat", "machine": machine_info(), "scenario": str(SCENARIO.relative_to(ROOT)),
              "nat": brief(nat, relays, trainers), "public": brief(public, relays, trainers)}
    if result["nat"]["tokens_per_s"] and result["public"]["tokens_per_s"]:
        result["tokens_per_s_ratio_nat_over_public"] = round(
            result["nat"]["tokens_per_s"] / result["public"]["tokens_per_s"], 3)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_nat.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
