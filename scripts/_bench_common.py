"""Helpers shared by the benchmarks in scripts/: machine facts, the CPU and memory a process tree
uses (from /proc and psutil), and small statistics. Nothing here imports the product."""

from __future__ import annotations

import glob
import math
import os
import platform
import sys
import time
from typing import Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    # A benchmark imports the product from its own checkout: run from a second worktree, the
    # editable install would otherwise give it the first one's code beside its nodes' (`python -m
    # node.cli` finds the worktree's, from its working directory).
    sys.path.insert(1, REPO_ROOT)


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def emit_report(out: dict, path: Optional[str]) -> None:
    """A benchmark's result: one JSON line on stdout, and indented to `path` if given."""
    import json

    print(json.dumps(out, default=str), flush=True)
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(out, indent=2, default=str) + "\n")


def machine_info() -> dict:
    import hivemind
    import torch

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": model,
        "torch": torch.__version__,
        "hivemind": hivemind.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _proc_kb(path: str, field: str) -> Optional[int]:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_tree(pid: int) -> list:
    """The node process and every descendant, as psutil.Process objects (missing ones skipped)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def memory_of(pid: int) -> dict:
    """Peak and current RSS of a node process alone and summed with its children, plus tree PSS."""
    tree = process_tree(pid)
    rows = []
    for proc in tree:
        try:
            name = proc.name()
        except Exception:  # noqa: BLE001 - it may have exited between listing and reading
            name = "?"
        rows.append({
            "pid": proc.pid, "name": name,
            "hwm_kb": _proc_kb(f"/proc/{proc.pid}/status", "VmHWM") or 0,
            "rss_kb": _proc_kb(f"/proc/{proc.pid}/status", "VmRSS") or 0,
            "pss_kb": _proc_kb(f"/proc/{proc.pid}/smaps_rollup", "Pss"),
        })
    if not rows:
        return {"error": f"process {pid} is gone"}
    mb = lambda kb: round(kb / 1024, 1)  # noqa: E731
    pss = [r["pss_kb"] for r in rows]
    return {
        "node_peak_rss_mb": mb(rows[0]["hwm_kb"]),
        "with_children_peak_rss_mb": mb(sum(r["hwm_kb"] for r in rows)),
        "node_rss_mb": mb(rows[0]["rss_kb"]),
        "with_children_rss_mb": mb(sum(r["rss_kb"] for r in rows)),
        "with_children_pss_mb": mb(sum(pss)) if all(p is not None for p in pss) else None,
        "processes": [{"pid": r["pid"], "name": r["name"], "peak_rss_mb": mb(r["hwm_kb"])} for r in rows],
    }


def rss_mb(pid: int) -> Optional[float]:
    """Current resident memory of one process (not its children), in MB."""
    kb = _proc_kb(f"/proc/{pid}/status", "VmRSS")
    return None if kb is None else round(kb / 1024, 1)


def cpu_by_part(pid: int) -> dict[str, float]:
    """User+system CPU seconds used so far by a node, split into the agora-node process itself,
    hivemind's forked DHT process, the p2pd daemon and anything else (torch_shm_manager)."""
    parts = {"node": 0.0, "dht_process": 0.0, "p2pd": 0.0, "other": 0.0}
    for proc in process_tree(pid):
        try:
            t = proc.cpu_times()
            name = proc.name()
        except Exception:  # noqa: BLE001 - it may have exited meanwhile
            continue
        if proc.pid == pid:
            part = "node"
        elif name == "p2pd":
            part = "p2pd"
        elif name.startswith("python"):
            part = "dht_process"
        else:
            part = "other"
        parts[part] += t.user + t.system
    return parts


def cpu_seconds(pid: int) -> float:
    """User+system CPU seconds used so far by a node and its live children."""
    return sum(cpu_by_part(pid).values())


def system_busy_s() -> float:
    """CPU seconds all cores of this machine have spent busy since boot (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds(exclude_pids: set[int]) -> float:
    """CPU seconds of this benchmark process and its children (the seed DHT process and its
    p2pd), not counting the agora-node processes it launched (they are children too)."""
    total = 0.0
    for proc in process_tree(os.getpid()):
        if proc.pid in exclude_pids:
            continue
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001
            continue
    return total


class CpuMeter:
    """Cores used over an interval: by this process tree and by everything else on the machine.
    Other work on a shared 2-core machine (someone's test run) distorts every number here, so
    each measurement reports how busy the rest of the machine was while it ran."""

    def __init__(self, exclude_pids: set[int] = frozenset()):
        self.exclude = set(exclude_pids)
        self.start()

    def start(self) -> None:
        self.t, self.busy, self.own = time.monotonic(), system_busy_s(), own_cpu_seconds(self.exclude)

    def read(self, tracked_cores: float = 0.0) -> dict:
        """`tracked_cores`: cores used in the interval by processes measured elsewhere (nodes)."""
        wall = max(time.monotonic() - self.t, 1e-9)
        busy = (system_busy_s() - self.busy) / wall
        own = (own_cpu_seconds(self.exclude) - self.own) / wall
        return {"machine_busy_cores": rounded(busy, 2), "benchmark_process_cores": rounded(own, 2),
                "foreign_cores": rounded(max(0.0, busy - own - tracked_cores), 2)}


def remove_own_shared_memory(pids) -> list[str]:
    """Unlink /dev/shm/torch_<pid>_* of the given pids (only ever this benchmark's own)."""
    removed = []
    for pid in pids:
        for path in glob.glob(f"/dev/shm/torch_{int(pid)}_*"):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def dialable_maddrs(maddrs) -> list:
    """Multiaddrs without their trailing /p2p/<peer id>: p2pd's connect refuses addresses that
    still carry it ("length greater than remaining number of bytes in buffer")."""
    from hivemind.utils.multiaddr import Multiaddr

    return [Multiaddr(str(m).split("/p2p/", 1)[0]) for m in maddrs]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def rounded(x: Optional[float], nd: int = 3) -> Optional[float]:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)
