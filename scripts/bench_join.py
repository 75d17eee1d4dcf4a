#!/usr/bin/env python
"""How fast a SIGKILLed worker serves again: a real swarm on 127.0.0.1 (an
authorizer, `--stages` stages of `--replicas` workers each, `--trainers` trainers, the tiny
preset) trains while every `--every-s` seconds a `--fraction` of the workers (at least one) is
SIGKILLed and restarted with the same `--identity` and listen port (at once, or `--restart-delay-s`
later), as a contributor's supervisor (systemd `Restart=always`) does.

Per restart it reports the seconds from the restart to

- each phase of the join, read from the worker's JSON log: admitted, joined the swarm (DHT
  bootstrap done), the averager process started, joined the stage (state loaded), and
- `ready_s`: the readiness line (the worker serves forwards from then on), and
- `serving_s`: the first request it answered (its Prometheus counter of requests moves), and
- `cpu_s_at_ready`: the CPU seconds its processes had used by then (against `ready_s`: how much of
  the start was computing, and how much waiting for a core or the network), and
- `phases_cpu_s`: the CPU seconds its processes had used by the end of each phase (sampled every
  0.2 s): where a start's computing goes.

At the end the trainers are stopped with SIGTERM and their summaries say where every sample went:
each sample started is completed or dropped with a reason (`samples_accounted`).

Prints one JSON object (and writes it with --out). Every process it starts is stopped.

    .venv/bin/python scripts/bench_join.py [--duration-s 150] [--every-s 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from scripts._bench_common import log, machine_info, rounded  # noqa: E402

PHASES = {
    # phase -> a fragment of the worker's log message that marks its end
    "admitted": "admitted to run",
    "swarm_joined": "joined the swarm as",
    "averager_started": "averager started",
    "stage_joined": "joined stage",
}
ADMIN_TOKEN = "bench-join-admin-token-0123456789"


def _log_phases(path: str, since_unix: float) -> dict:
    """Seconds from `since_unix` to the first log line of each phase (a JSON log: ms timestamps),
    and the sync phase the worker joined its stage in (`joined_as`)."""
    found: dict = {}
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return found
    for line in lines:
        try:
            entry = json.loads(line)
            at = datetime.datetime.fromisoformat(entry["ts"]).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        found.setdefault("first_line", round(at - since_unix, 2))
        message = str(entry.get("message", ""))
        if "joined stage" in message and "joined_as" not in found:
            # "joined stage 0 in weight_sync: ..." - a worker in weight sync is ready but hidden from trainers
            found["joined_as"] = message.split(" in ", 1)[1].split(":", 1)[0] if " in " in message else message
        for phase, fragment in PHASES.items():
            if phase not in found and fragment in message:
                found[phase] = round(at - since_unix, 2)
    return found


def _served(url: str) -> float:
    from node.netlab.scenario import _sum, scrape

    return _sum(scrape(url, timeout_s=2.0), "agora_worker_requests_total", outcome="ok")


class Bench:
    def __init__(self, args, workdir: str):
        from node.launcher import LocalSwarm
        from protocol.run_config import dump_run_config, load_run_config

        self.args = args
        self.workdir = workdir
        stages = _even_stages(args.stages, load_run_config("tiny").model.n_layers)
        self.config = os.path.join(workdir, "run.yaml")
        dump_run_config(load_run_config("tiny", {"run_id": f"join-{uuid.uuid4().hex[:6]}", "stages": stages,
                                                 "evaluation": {"every_steps": 0}}), self.config)
        self.swarm = LocalSwarm(os.path.join(workdir, "nodes"), None,
                                common_args=["--log-format", "json", "--announce-period-s", str(args.announce_period_s)])
        self.authorizer = None
        self.workers: dict[str, dict] = {}
        """name -> {"stage", "key", "port", "node"}"""
        self.trainers: list = []
        self.restarts: list[dict] = []
        self._threads: list[threading.Thread] = []

    # -- nodes ------------------------------------------------------------------------------------
    def start(self) -> None:
        policy = os.path.join(self.workdir, "policy.yaml")
        with open(policy, "w") as f:
            f.write("honor_stage_preference: true\n")
        capacity = ",".join(str(self.args.replicas + 1) for _ in range(self.args.stages))
        self.authorizer = self.swarm.start_authorizer([
            "--run-config", self.config, "--data-dir", os.path.join(self.workdir, "authorizer"), "--port", "0",
            "--admin-token", ADMIN_TOKEN, "--policy-file", policy, "--stage-capacity", capacity,
            "--credential-ttl-s", "1800", "--log-format", "json"], timeout_s=120)
        names = [f"w{s}{chr(ord('a') + r)}" for s in range(self.args.stages) for r in range(self.args.replicas)]
        for name in names:
            self.workers[name] = {"stage": int(name[1:-1]), "key": os.path.join(self.workdir, f"{name}.key"),
                                  "port": 0, "node": None, "incarnation": 0}
        first, *rest = names
        self._start_worker(first, wait_ready=True)
        for name in rest:
            self._start_worker(name, wait_ready=False)
        for name in rest:
            self.swarm.wait_ready(self.workers[name]["node"], timeout_s=180)
        for name in names:
            node = self.workers[name]["node"]
            self.workers[name]["port"] = int(node.maddrs[0].split("/tcp/")[1].split("/")[0])
        for i in range(self.args.trainers):
            self.trainers.append(self.swarm.start("trainer", name=f"trainer-{i}", timeout_s=180, args=[
                "--authorizer", self.authorizer.url, "--account-token", f"trainer-{i}",
                "--identity", os.path.join(self.workdir, f"trainer-{i}.key"),
                "--lanes", str(self.args.lanes), "--max-samples", "100000000"]))

    def _start_worker(self, name: str, wait_ready: bool, timeout_s: float = 180.0, tree: Optional[str] = None):
        """Start (or restart) a worker; `tree`: run the agora-node of that source tree instead of this one."""
        spec = self.workers[name]
        peers = self._initial_peers(name)
        args = ["--authorizer", self.authorizer.url, "--account-token", f"bench-{name}", "--identity", spec["key"],
                "--host-maddrs", f"/ip4/127.0.0.1/tcp/{spec['port']}", "--metrics-port", "0"]
        if peers:
            args += ["--initial-peers", *peers]
        label = name if spec["incarnation"] == 0 else f"{name}.{spec['incarnation']}"
        spec["incarnation"] += 1
        prefix = ["env", "-C", tree, f"PYTHONPATH={tree}"] if tree else ()  # `python -m` imports from its cwd
        node = self.swarm.start("worker", stage=spec["stage"], name=label, args=args, wait_ready=wait_ready,
                                timeout_s=timeout_s, prefix=prefix)
        spec["node"] = node
        return node

    def _initial_peers(self, name: str) -> list[str]:
        for other, spec in self.workers.items():
            node = spec["node"]
            if other != name and node is not None and node.ready.is_set() and node.proc.poll() is None:
                return node.maddrs[:1]
        return []

    # -- churn ------------------------------------------------------------------------------------
    def churn(self) -> None:
        rng = random.Random(self.args.seed)
        t0 = time.monotonic()
        restarts = 0
        next_at = self.args.every_s
        while time.monotonic() - t0 < self.args.duration_s:
            if time.monotonic() - t0 < next_at:
                time.sleep(0.2)
                continue
            next_at += self.args.every_s
            alive = [n for n, s in self.workers.items() if s["node"].proc.poll() is None]
            count = max(1, math.floor(self.args.fraction * len(self.workers)))
            for name in rng.sample(sorted(alive), min(count, len(alive))):
                self.swarm.stop(self.workers[name]["node"], signal.SIGKILL, timeout_s=5)
                log(f"t={time.monotonic() - t0:.0f}s: killed {name}, restarting it")
                # with --baseline, every other restart runs the baseline tree: both under the same load
                tree = self.args.baseline if self.args.baseline and restarts % 2 == 1 else None
                restarts += 1
                thread = threading.Thread(target=self._restart, args=(name, time.monotonic() - t0, tree,
                                                                      self.args.restart_delay_s), daemon=True)
                thread.start()
                self._threads.append(thread)
        for thread in self._threads:
            thread.join(self.args.restart_timeout_s + 10)

    def _restart(self, name: str, t_s: float, tree: Optional[str] = None, delay_s: float = 0.0) -> None:
        time.sleep(delay_s)  # the machine was down for a while
        started, started_unix = time.monotonic(), time.time()
        row: dict = {"node": name, "t_s": round(t_s, 1), "tree": "baseline" if tree else "this"}
        self.restarts.append(row)
        trace = None
        try:
            node = self._start_worker(name, wait_ready=False, tree=tree)
            trace = _CpuTrace(node.pid)
            self.swarm.wait_ready(node, timeout_s=self.args.restart_timeout_s)
            row["ready_s"] = round(time.monotonic() - started, 2)
            row["cpu_s_at_ready"] = _tree_cpu_s(node.pid)
            trace.stop()
            url = _metrics_url(node)
            deadline = started + self.args.restart_timeout_s
            while time.monotonic() < deadline and node.proc.poll() is None:
                if url and _served(url) > 0:
                    row["serving_s"] = round(time.monotonic() - started, 2)
                    break
                time.sleep(0.25)
        except Exception as exc:  # noqa: BLE001 - a restart that fails is a result
            row["error"] = str(exc).splitlines()[0][:300]
        row["phases_s"] = _log_phases(self.workers[name]["node"].log_path, started_unix)
        if trace is not None:
            trace.stop()
            row["phases_cpu_s"] = {phase: trace.at(started_unix + at_s) for phase, at_s in row["phases_s"].items()
                                   if isinstance(at_s, (int, float))}
        log(f"restart of {name}: {row}")

    # -- end --------------------------------------------------------------------------------------
    def finish(self) -> dict:
        summaries = []
        for trainer in self.trainers:
            self.swarm.stop(trainer, signal.SIGTERM, timeout_s=60)
            summaries.append(trainer.summary() or {})
        samples = {key: sum(s.get(key, 0) for s in summaries)
                   for key in ("samples_started", "samples_completed", "samples_dropped", "samples_in_flight")}
        reasons: dict[str, int] = {}
        for s in summaries:
            for reason, n in (s.get("dropped_by_reason") or {}).items():
                reasons[reason] = reasons.get(reason, 0) + n
        samples["dropped_by_reason"] = reasons
        samples["accounted"] = (samples["samples_completed"] + samples["samples_dropped"] == samples["samples_started"]
                                and samples["samples_in_flight"] == 0 and sum(reasons.values()) == samples["samples_dropped"]
                                and all(summaries))
        return samples

    def stop(self) -> None:
        self.swarm.stop_all(timeout_s=30)


def _metrics_url(node) -> Optional[str]:
    for line in node.stdout_lines:
        if "metrics=" in line:
            url = line.split("metrics=", 1)[1].split()[0]
            return url if url.endswith("/metrics") else url.rstrip("/") + "/metrics"
    return None


def _even_stages(stages: int, n_layers: int) -> list[dict]:
    cuts = [round(i * n_layers / stages) for i in range(stages + 1)]
    return [{"first_layer": cuts[i], "last_layer": cuts[i + 1]} for i in range(stages)]


def _median(rows: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in rows if r.get(key) is not None]
    return rounded(statistics.median(values), 2) if values else None


def _tree_cpu_s(pid: int) -> Optional[float]:
    """CPU seconds (user + system) the node's process and its live descendants (p2pd, the DHT and
    averager processes) have used: against `ready_s`, how much of a start was waiting for a core."""
    import psutil

    try:
        root = psutil.Process(pid)
        total = 0.0
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return round(total, 2)
    except psutil.Error:
        return None


class _CpuTrace:
    """The CPU seconds of a node's process tree, sampled every 0.2 s from its start until stopped."""

    def __init__(self, pid: int):
        self.pid = pid
        self.samples: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.2):
            cpu = _tree_cpu_s(self.pid)
            if cpu is None:
                return
            self.samples.append((time.time(), cpu))

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)

    def at(self, unix_s: float) -> Optional[float]:
        """CPU seconds by `unix_s`: the last sample taken before it."""
        before = [cpu for t, cpu in self.samples if t <= unix_s]
        return before[-1] if before else None


def _max(rows: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in rows if r.get(key) is not None]
    return rounded(max(values), 2) if values else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2, help="workers per stage")
    p.add_argument("--trainers", type=int, default=1)
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--duration-s", type=float, default=150.0, help="churn for this long after the trainers start")
    p.add_argument("--every-s", type=float, default=30.0, help="kill and restart workers this often")
    p.add_argument("--fraction", type=float, default=0.25, help="of the workers killed each time (at least one)")
    p.add_argument("--restart-delay-s", type=float, default=0.0, help="restart a killed worker this much later")
    p.add_argument("--announce-period-s", type=float, default=5.0)
    p.add_argument("--restart-timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--baseline", help="a source tree (another checkout) whose agora-node every other restart runs, "
                                      "to compare two versions under the same load")
    p.add_argument("--keep", help="keep the nodes' logs in this directory instead of a temporary one")
    args = p.parse_args()

    report: dict = {"machine": machine_info(), "args": vars(args)}
    tmp = tempfile.TemporaryDirectory(prefix="agora-bench-join-")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    bench = Bench(args, args.keep or tmp.name)
    try:
        bench.start()
        log(f"swarm up: {len(bench.workers)} workers, {len(bench.trainers)} trainer(s); churning for "
            f"{args.duration_s:.0f}s")
        bench.churn()
        report["samples"] = bench.finish()
    finally:
        bench.stop()
        tmp.cleanup()
    rows = sorted(bench.restarts, key=lambda r: r["t_s"])
    report["restarts"] = rows
    for tree in ("this", "baseline"):
        mine = [r for r in rows if r["tree"] == tree]
        if not mine:
            continue
        phases = sorted({k for r in mine for k in r.get("phases_s", {}) if k != "joined_as"})
        report[f"median_s_{tree}" if args.baseline else "median_s"] = {
            "restarts": len(mine), "ready": _median(mine, "ready_s"), "serving": _median(mine, "serving_s"),
            "cpu_at_ready": _median(mine, "cpu_s_at_ready"),
            **{k: _median([r["phases_s"] for r in mine], k) for k in phases}}
        report[f"median_cpu_s_{tree}" if args.baseline else "median_cpu_s"] = {
            k: _median([r.get("phases_cpu_s", {}) for r in mine], k) for k in phases}
        report[f"max_s_{tree}" if args.baseline else "max_s"] = {
            "ready": _max(mine, "ready_s"), "serving": _max(mine, "serving_s"),
            **{k: _max([r["phases_s"] for r in mine], k) for k in phases}}
        serving = [r.get("serving_s") for r in mine]
        report[f"max_serving_s_{tree}" if args.baseline else "max_serving_s"] = (
            None if None in serving else max(serving))  # None: a restart never served
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
