"""What a lab leaves on the machine while it runs, and how the leftovers of a dead lab are removed.

A running lab owns, all named `<prefix>-<lab id>...` (plan.py):
  - one network namespace per host (`ip netns`: a bind mount under /run/netns),
  - a TUN device in each namespace and one in the root namespace (the controller's); they belong
    to the switch process and vanish with it,
  - the switch process (`python -m node.netlab.switch --lab-id ID`) and the processes started in
    the namespaces,
  - its state file STATE_DIR/<lab id>.json: who owns the lab (pid and start time) and what it made.
Lab.stop() removes all of it. If the controller died without stopping (SIGKILL, a crash), the
switch dies with it and the devices with the switch; `cleanup_stale` removes the rest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any, Optional

import psutil

from node.netlab.plan import PREFIX, lab_id_of

STATE_DIR = "/run/agora-netlab"


def state_path(lab_id: str) -> str:
    return os.path.join(STATE_DIR, f"{lab_id}.json")


def write_state(lab_id: str, state: dict[str, Any]) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    me = psutil.Process()
    record = {"owner_pid": me.pid, "owner_started": me.create_time(), **state}
    tmp = state_path(lab_id) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, state_path(lab_id))


def read_state(lab_id: str) -> Optional[dict[str, Any]]:
    try:
        with open(state_path(lab_id)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def remove_state(lab_id: str) -> None:
    try:
        os.unlink(state_path(lab_id))
    except FileNotFoundError:
        pass


def owner_alive(state: Optional[dict[str, Any]]) -> bool:
    if not state:
        return False
    try:
        process = psutil.Process(int(state["owner_pid"]))
        return abs(process.create_time() - float(state["owner_started"])) < 1.0
    except (psutil.Error, KeyError, ValueError):
        return False


def run(argv: list[str], *, check: bool = False, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, input=input, capture_output=True, text=True, check=check, timeout=30)


def list_netns(prefix: str = PREFIX) -> list[str]:
    out = run(["ip", "netns", "list"]).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if lab_id_of(prefix, n)]


def list_root_devices(prefix: str = PREFIX) -> list[str]:
    out = run(["ip", "-j", "link", "show"]).stdout
    try:
        links = json.loads(out or "[]")
    except ValueError:
        return []
    return [link["ifname"] for link in links if lab_id_of(prefix, link.get("ifname", ""))]


def netns_pids(netns: str) -> list[int]:
    out = run(["ip", "netns", "pids", netns]).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def switch_processes(prefix: str = PREFIX) -> dict[int, str]:
    """pid -> lab id of every switch process on the machine."""
    found = {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if "node.netlab.switch" in cmdline and "--lab-id" in cmdline:
            i = cmdline.index("--lab-id")
            if i + 1 < len(cmdline) and lab_id_of(prefix, f"{prefix}-{cmdline[i + 1]}"):
                found[process.info["pid"]] = cmdline[i + 1]
    return found


def kill_pids(pids: list[int], *, grace_s: float = 0.0) -> list[int]:
    """SIGTERM, wait up to `grace_s`, then SIGKILL whatever is left; returns the pids signalled."""
    signalled = []
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        if sig == signal.SIGTERM and grace_s <= 0:
            continue
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        signalled.extend(p for p in alive if p not in signalled)
        deadline = time.monotonic() + wait_s
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            if alive:
                time.sleep(0.02)
        pids = alive
        if not pids:
            break
    return signalled


def remove_lab(lab_id: str, prefix: str = PREFIX, *, grace_s: float = 0.0) -> list[str]:
    """Remove everything of lab `lab_id` that is still there; returns what was removed."""
    removed = []
    namespaces = [n for n in list_netns(prefix) if lab_id_of(prefix, n) == lab_id]
    for netns in namespaces:
        for pid in kill_pids(netns_pids(netns), grace_s=grace_s):
            removed.append(f"process {pid} in {netns}")
    for pid, owner in switch_processes(prefix).items():
        if owner == lab_id:
            kill_pids([pid])
            removed.append(f"process {pid} (switch of {prefix}-{lab_id})")
    for netns in namespaces:
        if run(["ip", "netns", "delete", netns]).returncode == 0:
            removed.append(f"netns {netns}")
    for device in list_root_devices(prefix):
        if lab_id_of(prefix, device) == lab_id and run(["ip", "link", "delete", device]).returncode == 0:
            removed.append(f"device {device}")
    if os.path.exists(state_path(lab_id)):
        remove_state(lab_id)
        removed.append(f"state {state_path(lab_id)}")
    return removed


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Remove the leftovers of every lab whose controller process is gone: processes in its
    namespaces, its switch, namespaces, devices and state file. Labs whose controller is alive
    are left alone. Returns one line per thing removed."""
    lab_ids = {lab_id_of(prefix, n) for n in list_netns(prefix)}
    lab_ids |= {lab_id_of(prefix, d) for d in list_root_devices(prefix)}
    lab_ids |= set(switch_processes(prefix).values())
    if os.path.isdir(STATE_DIR):
        for name in os.listdir(STATE_DIR):
            if name.endswith(".json"):
                state = read_state(name[:-5])
                if state and state.get("prefix") == prefix:
                    lab_ids.add(name[:-5])
    removed = []
    for lab_id in sorted(i for i in lab_ids if i):
        if not owner_alive(read_state(lab_id)):
            removed.extend(remove_lab(lab_id, prefix))
    return removed
