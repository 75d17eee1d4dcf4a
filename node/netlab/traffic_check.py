"""Each worker's bytes on its lab link against what the bandwidth plan (roles/model/traffic_plan.py)
predicts for the work the worker reported: its forward and backward requests times the plan's
bytes per sample, plus its averaging rounds times the plan's bytes per round in its role.

The switch counts IP bytes, so the measured side includes TCP/IP headers (about 3.5%), DHT
traffic, metrics scrapes and libp2p framing; the plan counts tensor payloads only. Agreement
within 20% says the plan's arithmetic describes what the swarm really sends.
"""

from __future__ import annotations

from typing import Any, Optional


def predicted_bytes(stage, counters: dict, rounds: list[dict], *, reducer: bool, reducers: int) -> dict[str, int]:
    """Bytes the plan predicts this worker sent and received for `counters` and `rounds`."""
    forwards = int(counters.get("forward_requests", 0))
    backwards = int(counters.get("backward_requests", 0))
    sent = forwards * stage.forward_bytes_out + backwards * stage.backward_bytes_out
    received = forwards * stage.forward_bytes_in + backwards * stage.backward_bytes_in
    payload = stage.round_bytes(4)
    for record in rounds:
        if record.get("status") in ("skipped", "failed"):
            continue
        group = max(1, int(record.get("group_size") or 1))
        r = max(1, min(reducers, group))
        if reducer:
            # its parts to the other reducers, then its reduced slice back to every other peer
            sent += round(payload * (r - 1) / r + payload * (group - 1) / r)
            received += round(payload * (group - 1) / r + payload * (r - 1) / r)
        else:
            sent += payload  # every part goes to a reducer, and every reduced part comes back
            received += payload
    return {"sent": sent, "received": received}


def traffic_vs_plan(result: dict[str, Any], run_config_path: str) -> list[dict[str, Any]]:
    """One row per worker that printed a summary and whose host has switch counters."""
    from protocol.run_config import load_run_config
    from roles.model.traffic_plan import plan_traffic

    run = load_run_config(run_config_path)
    plan = plan_traffic(run)
    specs = {node["name"]: node for node in result.get("nodes", [])}
    reducers_per_stage: dict[int, int] = {}
    for node in specs.values():
        if node["role"] == "worker" and node.get("reducer"):
            reducers_per_stage[node["stage"]] = reducers_per_stage.get(node["stage"], 0) + 1
    rows = []
    for item in result.get("summaries", []):
        name = item["name"]
        if item["role"] != "worker" or not item.get("summary") or "." in name or name not in specs:
            continue  # only a host's first and only incarnation: the switch counts per host
        if any(other["name"].startswith(name + ".") for other in result.get("summaries", [])):
            continue
        measured = (result.get("traffic") or {}).get(name)
        if not measured:
            continue
        summary = item["summary"]
        stage = plan.stage(item["stage"])
        rounds = (summary.get("averaging") or {}).get("rounds", [])
        predicted = predicted_bytes(stage, summary.get("counters", {}), rounds, reducer=bool(specs[name].get("reducer")),
                                    reducers=reducers_per_stage.get(item["stage"], 1))
        rows.append({
            "node": name, "stage": item["stage"], "reducer": bool(specs[name].get("reducer")),
            "predicted_sent": predicted["sent"], "measured_sent": int(measured.get("tx_bytes", 0)),
            "predicted_received": predicted["received"], "measured_received": int(measured.get("rx_bytes", 0)),
            "sent_ratio": _ratio(measured.get("tx_bytes", 0), predicted["sent"]),
            "received_ratio": _ratio(measured.get("rx_bytes", 0), predicted["received"]),
        })
    return rows


def _ratio(measured: float, predicted: float) -> Optional[float]:
    return round(measured / predicted, 3) if predicted else None
