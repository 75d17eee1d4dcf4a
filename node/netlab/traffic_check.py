"""Each worker's bytes on its lab link against what the bandwidth plan (roles/model/traffic_plan.py)
predicts for the work the worker reported: its forward and backward requests times the plan's
bytes per sample, plus its averaging rounds times the plan's bytes per round in its role.

The switch counts IP bytes, so the measured side includes TCP/IP headers (about 3.5%), DHT
traffic, metrics scrapes and libp2p framing; the plan counts tensor payloads only. Agreement
within 20% says the plan's arithmetic describes what the swarm really sends.

A worker's summary lists the rounds it finished. A step round that was due by its last step but
is not listed was cut by the scenario's stop while its bytes were on the wire (a whole round's
payload on a 200 Mbit/s link at this scale), so it is predicted as a whole round of the stage's
group and reported as `rounds_cut_by_stop`; since it was cut part way, such a worker's measured
bytes lie between the prediction without it (`*_ratio_finished`) and with it (`*_ratio`).
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


def rounds_cut_by_stop(summary: dict, average_every: int) -> list[dict]:
    """Step rounds due by the worker's last step that its summary does not list (see module
    docstring), as round records of the group size of its last listed round."""
    rounds = (summary.get("averaging") or {}).get("rounds", [])
    step_rounds = [r for r in rounds if r.get("kind") == "step"]
    due = int(summary.get("local_step", 0)) // max(1, average_every)
    groups = [int(r.get("group_size") or 0) for r in step_rounds if int(r.get("group_size") or 0) > 1]
    group = groups[-1] if groups else 0
    if group <= 1:
        return []
    return [{"status": "cut_by_stop", "group_size": group}] * max(0, due - len(step_rounds))


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
        cut = rounds_cut_by_stop(summary, run.averaging.average_every)
        rounds = (summary.get("averaging") or {}).get("rounds", []) + cut
        reducer, reducers = bool(specs[name].get("reducer")), reducers_per_stage.get(item["stage"], 1)
        predicted = predicted_bytes(stage, summary.get("counters", {}), rounds, reducer=reducer, reducers=reducers)
        finished = predicted_bytes(stage, summary.get("counters", {}), rounds[:len(rounds) - len(cut)],
                                   reducer=reducer, reducers=reducers)
        rows.append({
            "node": name, "stage": item["stage"], "reducer": reducer,
            "predicted_sent": predicted["sent"], "measured_sent": int(measured.get("tx_bytes", 0)),
            "predicted_received": predicted["received"], "measured_received": int(measured.get("rx_bytes", 0)),
            "rounds_cut_by_stop": len(cut),
            "sent_ratio": _ratio(measured.get("tx_bytes", 0), predicted["sent"]),
            "received_ratio": _ratio(measured.get("rx_bytes", 0), predicted["received"]),
            "sent_ratio_finished": _ratio(measured.get("tx_bytes", 0), finished["sent"]),
            "received_ratio_finished": _ratio(measured.get("rx_bytes", 0), finished["received"]),
        })
    return rows


def _ratio(measured: float, predicted: float) -> Optional[float]:
    return round(measured / predicted, 3) if predicted else None
