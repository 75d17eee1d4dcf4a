"""Start and stop real `agora-node` processes on this machine: used by the demo, the
integration tests and the benchmarks, so all three exercise exactly what a user runs.

Each node runs in its own session (process group), so a stop can reap the node together with
every child it started (hivemind's DHT process, p2pd) even if the node itself died hard.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import psutil

from node.lifecycle import descendant_pids, remove_shared_memory, shared_memory_files
from protocol.readiness import parse_ready_line

READY_TIMEOUT_S = 120.0
"""How long a started node may take to print its readiness line. Alone one takes 5-15 s; on a
2-core CI machine running two swarms at once, a node's imports (4-6 s of CPU) and its DHT
bootstrap have taken over 60 s."""


class NodeStartError(RuntimeError):
    pass


@dataclass
class NodeProcess:
    name: str
    role: str
    stage: Optional[int]
    proc: subprocess.Popen
    log_path: str
    stdout_lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    peer_id: str = ""
    maddrs: list[str] = field(default_factory=list)
    url: str = ""
    """An authorizer's HTTP address."""
    known_pids: set[int] = field(default_factory=set)
    """The node and every descendant seen so far, for cleaning up after a hard kill."""
    started_at: float = field(default_factory=time.time)
    """Before the node started (set when it is launched): its segments are younger."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def summary(self) -> Optional[dict]:
        """The trainer's final JSON summary line, if it printed one."""
        for line in reversed(self.stdout_lines):
            if line.startswith("{"):
                try:
                    return json.loads(line).get("summary")
                except json.JSONDecodeError:
                    continue
        return None

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


def _dump_stacks(node: NodeProcess) -> None:
    """Have a node that hangs, and its Python children, write their threads' stacks to its log
    (SIGUSR1, node/lifecycle.py), so the error shows where it stood."""
    try:
        processes = [psutil.Process(node.proc.pid)]
        processes += [child for child in processes[0].children(recursive=True) if "python" in child.name()]
    except psutil.Error:
        return
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGUSR1)
    time.sleep(1.0)


def _pump_stdout(node: NodeProcess) -> None:
    for raw in node.proc.stdout:
        line = raw.rstrip("\n")
        node.stdout_lines.append(line)
        fields = parse_ready_line(line)
        if fields is not None and not node.ready.is_set():
            node.peer_id = fields.get("peer", "")
            if fields.get("stage", "-").isdigit():
                node.stage = int(fields["stage"])  # an authorizer may have chosen it
            node.maddrs = [m for m in fields.get("maddrs", "").split(",") if m]
            node.url = fields.get("url", "")
            node.ready.set()


class LocalSwarm:
    """A set of agora-node processes sharing one run config, bootstrapped from the first node."""

    def __init__(self, workdir: str, config: Optional[str], *, torch_threads: int = 1,
                 extra_env: Optional[dict[str, str]] = None, common_args: Sequence[str] = (),
                 initial_peers: Sequence[str] = (), popen: Callable[..., subprocess.Popen] = subprocess.Popen):
        """`popen` starts each node (subprocess.Popen's signature); the tests pass one that forks
        nodes from an interpreter that has done their imports already (tests/support/node_zygote.py)."""
        self.workdir = workdir
        self.popen = popen
        self.config = config
        self.torch_threads = torch_threads
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(torch_threads),
                    **(extra_env or {})}
        self.common_args = list(common_args)
        self.nodes: list[NodeProcess] = []
        self.bootstrap_peers = list(initial_peers)
        os.makedirs(workdir, exist_ok=True)

    @property
    def initial_peers(self) -> list[str]:
        if self.bootstrap_peers:
            return self.bootstrap_peers
        for node in self.nodes:
            if node.role != "relay" and node.maddrs and node.ready.is_set() and node.proc.poll() is None:
                return node.maddrs[:1]
        return []

    def start_authorizer(self, args: Sequence[str] = (), *, name: str = "authorizer",
                         timeout_s: float = READY_TIMEOUT_S, prefix: Sequence[str] = ()) -> NodeProcess:
        """Start the authorizer as users do (`agora-node --role authorizer ...`) and wait for its
        readiness line's URL."""
        cmd = [*prefix, sys.executable, "-m", "node.cli", "--role", "authorizer", *args]
        return self._spawn(name, "authorizer", None, cmd, True, timeout_s)

    def start_relay(self, args: Sequence[str] = (), *, name: str = "relay", timeout_s: float = READY_TIMEOUT_S,
                    prefix: Sequence[str] = ()) -> NodeProcess:
        """Start one of the run's relays (`agora-node --role relay ...`, with --authorizer and the
        admin token in `args`) and wait for its readiness line."""
        cmd = [*prefix, sys.executable, "-m", "node.cli", "--role", "relay", *args]
        return self._spawn(name, "relay", None, cmd, True, timeout_s)

    def start(self, role: str, *, stage: Optional[int] = None, args: Sequence[str] = (), name: Optional[str] = None,
              wait_ready: bool = True, timeout_s: float = READY_TIMEOUT_S, env: Optional[dict[str, str]] = None,
              prefix: Sequence[str] = ()) -> NodeProcess:
        """Start one node; `env` adds environment variables for this node only (test hooks);
        `prefix` runs it through another command that execs it (the network lab's
        `ip netns exec NS`), so the pid is still the node's."""
        name = name or (f"{role}{stage}" if stage is not None else f"{role}") + f"-{len(self.nodes)}"
        cmd = [*prefix, sys.executable, "-m", "node.cli", "--role", role, "--torch-threads", str(self.torch_threads),
               *self.common_args]
        if self.config is not None:
            cmd += ["--config", self.config]
        if stage is not None:
            cmd += ["--stage", str(stage)]
        peers = self.initial_peers
        if peers and "--initial-peers" not in args:
            cmd += ["--initial-peers", *peers]
        cmd += list(args)
        if "--authorizer" not in cmd:
            cmd.append("--insecure-open-run")  # an explicit choice, as users must make it too
        return self._spawn(name, role, stage, cmd, wait_ready, timeout_s, env)

    def _spawn(self, name: str, role: str, stage: Optional[int], cmd: list[str], wait_ready: bool,
               timeout_s: float, env: Optional[dict[str, str]] = None) -> NodeProcess:
        log_path = os.path.join(self.workdir, f"{name}.log")
        log = open(log_path, "w")
        started_at = time.time()
        proc = self.popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                          env={**self.env, **(env or {})}, start_new_session=True)
        log.close()
        node = NodeProcess(name=name, role=role, stage=stage, proc=proc, log_path=log_path, started_at=started_at)
        threading.Thread(target=_pump_stdout, args=(node,), daemon=True).start()
        self.nodes.append(node)
        if wait_ready:
            self.wait_ready(node, timeout_s)
        return node

    def wait_ready(self, node: NodeProcess, timeout_s: float = READY_TIMEOUT_S) -> None:
        self._wait_ready(node, timeout_s)
        _remember_pids(node)

    def _wait_ready(self, node: NodeProcess, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not node.ready.wait(0.1):
            if node.proc.poll() is not None:
                raise NodeStartError(f"{node.name} exited with {node.proc.returncode}:\n{node.log_tail()}")
            if time.monotonic() > deadline:
                _dump_stacks(node)
                raise NodeStartError(f"{node.name} not ready after {timeout_s:.0f}s:\n{node.log_tail(200)}")

    def wait(self, node: NodeProcess, timeout_s: float) -> int:
        try:
            return node.proc.wait(timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"{node.name} still running after {timeout_s:.0f}s:\n{node.log_tail()}") from exc

    def stop(self, node: NodeProcess, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> Optional[int]:
        """Signal the node, wait for it, then kill whatever is left in its process group."""
        _remember_pids(node)
        if node.proc.poll() is None:
            try:
                node.proc.send_signal(sig)
                node.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        _kill_group(node.proc.pid)
        try:
            return node.proc.wait(5)
        except subprocess.TimeoutExpired:
            return None
        finally:
            remove_shared_memory(node.known_pids, born_after=node.started_at)

    def stop_all(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        live = [n for n in self.nodes if n.proc.poll() is None]
        for node in self.nodes:
            _remember_pids(node)
        for node in live:
            try:
                node.proc.send_signal(sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        for node in live:
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for node in self.nodes:
            _kill_group(node.proc.pid)
            try:
                node.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            remove_shared_memory(node.known_pids, born_after=node.started_at)
        # SIGKILLed grandchildren take a moment to be reaped on a loaded machine
        gone_by = time.monotonic() + 5
        while self.survivors() and time.monotonic() < gone_by:
            time.sleep(0.1)

    def leaked_shared_memory(self) -> list[str]:
        """/dev/shm segments left by any process of our nodes (should be none after stop_all)."""
        return [path for node in self.nodes for path in shared_memory_files(node.known_pids, node.started_at)]

    def survivors(self) -> list[int]:
        """Pids still alive in any of our nodes' process groups (should be none after stop_all)."""
        import psutil

        groups = {n.proc.pid for n in self.nodes}
        alive = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) in groups and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc.pid)
            except (ProcessLookupError, psutil.Error, OSError):
                continue
        return alive


def _remember_pids(node: NodeProcess) -> None:
    if node.proc.poll() is None:
        node.known_pids.add(node.proc.pid)
        node.known_pids.update(descendant_pids(node.proc.pid))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
