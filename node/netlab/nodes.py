"""Real agora-node processes on the hosts of a network lab: an authorizer, workers and trainers,
each alone in its namespace behind its shaped link, started exactly as a user starts them.

Every node listens on its host's lab address at a fixed port, so a node killed and restarted with
the same identity comes back at the same address, as a contributor behind a forwarded port does.
The controller (the root namespace, which the lab routes to every host) scrapes each node's
`/metrics` over the lab network; that traffic is a few KB per scrape and is counted like any other.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from node.launcher import LocalSwarm, NodeProcess

logger = logging.getLogger(__name__)

P2P_PORT = 4001
METRICS_PORT = 9400
AUTHORIZER_PORT = 8000


@dataclass
class NodeSpec:
    """One node of a scenario: its role, its stage (workers), its extra flags."""

    name: str
    role: str
    stage: Optional[int] = None
    reducer: bool = False
    args: list[str] = field(default_factory=list)


class LabSwarm:
    """The nodes of one scenario on the hosts of a started `Lab` (node/netlab/topology.py); the
    host of a node has the node's name."""

    def __init__(self, lab, workdir: str, run_config_path: str, *, torch_threads: int = 1,
                 announce_period_s: float = 2.0, monitor: bool = False,
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen):
        """`popen` starts each node (see LocalSwarm)."""
        self.lab = lab
        self.workdir = workdir
        self.run_config_path = run_config_path
        self.admin_token = secrets.token_hex(16)
        self.monitor = monitor
        self.announce_period_s = announce_period_s
        self.local = LocalSwarm(workdir, None, torch_threads=torch_threads, popen=popen)
        self.specs: dict[str, NodeSpec] = {}
        self.processes: dict[str, NodeProcess] = {}
        """The newest process of each node (a restarted node replaces its killed one)."""
        self.incarnations: dict[str, int] = {}
        self.authorizer: Optional[NodeProcess] = None
        self.bootstrap: list[str] = []

    # -- starting -------------------------------------------------------------------------------
    def start_authorizer(self, spec: NodeSpec, *, stage_capacity: list[int], timeout_s: float = 90.0) -> NodeProcess:
        """The run's authorizer, placing each worker on the stage it asks for (the scenario's
        topology), with `stage_capacity` workers per stage at most."""
        address = self.lab.address(spec.name)
        policy = os.path.join(self.workdir, "policy.yaml")
        with open(policy, "w") as f:
            f.write("honor_stage_preference: true\n")
        args = ["--run-config", self.run_config_path, "--data-dir", os.path.join(self.workdir, spec.name),
                "--host", address, "--port", str(AUTHORIZER_PORT), "--admin-token", self.admin_token,
                "--policy-file", policy, "--stage-capacity", ",".join(map(str, stage_capacity)),
                "--credential-ttl-s", "1800", *spec.args]
        if self.monitor:
            args += ["--monitor-host-maddrs", f"/ip4/{address}/tcp/{P2P_PORT}"]
        else:
            args.append("--no-monitor")
        self.specs[spec.name] = spec
        node = self.local.start_authorizer(args, name=spec.name, timeout_s=timeout_s,
                                           prefix=self.lab.command(spec.name, []))
        self.authorizer = node
        self.processes[spec.name] = node
        return node

    def start_node(self, spec: NodeSpec, *, wait_ready: bool = True, timeout_s: float = 120.0) -> NodeProcess:
        """Start (or restart, same identity and address) a worker or trainer on its host (a relay:
        start_relay)."""
        if spec.role == "relay":
            return self.start_relay(spec, timeout_s=timeout_s)
        if self.authorizer is None:
            raise RuntimeError("start the authorizer first")
        self.specs[spec.name] = spec
        address = self.lab.address(spec.name)
        incarnation = self.incarnations.get(spec.name, -1) + 1
        self.incarnations[spec.name] = incarnation
        args = ["--authorizer", self.authorizer.url, "--account-token", f"lab-{spec.name}",
                "--identity", os.path.join(self.workdir, f"{spec.name}.key"),
                "--host-maddrs", f"/ip4/{address}/tcp/{P2P_PORT}",
                "--metrics-port", str(METRICS_PORT), "--metrics-host", address,
                "--announce-period-s", str(self.announce_period_s)]
        if spec.role == "worker" and spec.reducer:
            args.append("--reducer")
        peers = self._initial_peers(spec.name)
        if peers:
            args += ["--initial-peers", *peers]
        args += spec.args
        name = spec.name if incarnation == 0 else f"{spec.name}.{incarnation}"
        node = self.local.start(spec.role, stage=spec.stage, args=args, name=name, wait_ready=wait_ready,
                                timeout_s=timeout_s, prefix=self.lab.command(spec.name, []))
        self.processes[spec.name] = node
        if wait_ready and node.maddrs and not self.bootstrap:
            self.bootstrap = node.maddrs[:1]
        return node

    def start_relay(self, spec: NodeSpec, *, timeout_s: float = 90.0) -> NodeProcess:
        """Start (or restart, same identity and address) one of the run's relays on its host."""
        if self.authorizer is None:
            raise RuntimeError("start the authorizer first")
        self.specs[spec.name] = spec
        address = self.lab.address(spec.name)
        incarnation = self.incarnations.get(spec.name, -1) + 1
        self.incarnations[spec.name] = incarnation
        args = ["--authorizer", self.authorizer.url, "--account-token", self.admin_token,
                "--identity", os.path.join(self.workdir, f"{spec.name}.key"),
                "--host-maddrs", f"/ip4/{address}/tcp/{P2P_PORT}",
                "--metrics-port", str(METRICS_PORT), "--metrics-host", address, *spec.args]
        name = spec.name if incarnation == 0 else f"{spec.name}.{incarnation}"
        node = self.local.start_relay(args, name=name, timeout_s=timeout_s, prefix=self.lab.command(spec.name, []))
        self.processes[spec.name] = node
        return node

    def _initial_peers(self, name: str) -> list[str]:
        """Any live node's address other than the one being started (a restarted first node must
        not bootstrap from itself)."""
        for other, node in self.processes.items():
            if other != name and node.role not in ("authorizer", "relay") and node.ready.is_set() \
                    and node.proc.poll() is None and node.maddrs:
                return node.maddrs[:1]
        return []

    # -- failures -------------------------------------------------------------------------------
    def kill(self, name: str) -> None:
        """SIGKILL the node and its process group: a machine that vanished mid-whatever."""
        node = self.processes[name]
        self.local.stop(node, sig=signal.SIGKILL, timeout_s=5)

    def alive(self, name: str) -> bool:
        node = self.processes.get(name)
        return node is not None and node.proc.poll() is None

    def restart(self, name: str, *, wait_ready: bool = True) -> tuple[NodeProcess, float]:
        """Start the node again with the same identity; returns it and the seconds until ready."""
        started = time.monotonic()
        node = self.start_node(self.specs[name], wait_ready=wait_ready)
        return node, time.monotonic() - started

    # -- observing ------------------------------------------------------------------------------
    def metrics_url(self, name: str) -> str:
        """The node's /metrics as the controller reaches it; "" for a node behind NAT, which the
        controller cannot reach (and whose LAN address must not go to the machine's default route)."""
        if self.lab.link_host(name) != name:
            return ""
        return f"http://{self.lab.address(name)}:{METRICS_PORT}/metrics"

    def stop_all(self, roles: Sequence[str] = ("trainer", "worker", "relay", "authorizer"),
                 timeout_s: float = 60.0) -> None:
        """SIGTERM role by role (trainers drain first, so every sample they started is accounted
        before the workers go), then reap everything."""
        for role in roles:
            live = [n for n in self.processes.values() if n.role == role and n.proc.poll() is None]
            for node in live:
                try:
                    node.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + timeout_s
            for node in live:
                try:
                    node.proc.wait(max(0.1, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - a node that ignores SIGTERM is killed below
                    logger.warning("%s did not stop within %.0fs of SIGTERM; killing it", node.name, timeout_s)
        self.local.stop_all(sig=signal.SIGKILL, timeout_s=5)
