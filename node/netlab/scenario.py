"""A lab scenario: a YAML file naming the run, the nodes and their links, and what happens to them
(preemptions, kills, restarts, churn, link changes) over a fixed duration; and the runner that
plays it on real agora-node processes and reports what the swarm did.

A scenario's result is one JSON-able dict: the links as measured, tokens/s after warm-up, every
trainer's sample accounting, each averaging round as the surviving workers saw it, the bytes each
host moved, CPU per node, and the time from each restart to serving. scripts/bench_network.py
builds its grids from these; tests/integration/test_netlab_scenario.py plays a short one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import psutil
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from node.netlab.nodes import LabSwarm, NodeSpec
from protocol.errors import ConfigError

logger = logging.getLogger(__name__)
_STRICT = ConfigDict(extra="forbid")
MOMENTS = ("now", "chunk_send", "reduced_send", "forward", "backward")


class LinkModel(BaseModel):
    """A host's access link; None is unshaped."""

    model_config = _STRICT
    up_mbit: Optional[float] = Field(default=None, gt=0)
    down_mbit: Optional[float] = Field(default=None, gt=0)
    rtt_ms: float = Field(default=0.0, ge=0)


class NodeModel(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,11}$")
    role: Literal["authorizer", "worker", "trainer", "relay"]
    stage: Optional[int] = Field(default=None, ge=0)
    reducer: bool = False
    args: list[str] = Field(default_factory=list)
    link: Optional[Union[str, LinkModel]] = None
    """A link of its own, or the name of one of the scenario's `links` (e.g. `contributor`);
    None: the scenario's link named after the node's role, else unshaped."""
    behind: Optional[str] = None
    """One of the scenario's `routers`: the node sits on that home router's LAN, behind NAT, and
    its traffic takes the router's link (a node behind a router has no link of its own)."""


class RouterModel(BaseModel):
    """A home router (node/netlab/topology.py, HostSpec.behind): it masquerades whatever its LAN
    sends out; nothing outside can connect in. Behind another router, it is a second level of NAT
    (a stand-in for carrier-grade NAT)."""

    model_config = _STRICT
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,11}$")
    link: Optional[Union[str, LinkModel]] = None
    """Its access link (a named one, or its own); a router behind another takes the other's."""
    behind: Optional[str] = None


class EventModel(BaseModel):
    """One thing that happens at `at_s` seconds after the trainers started."""

    model_config = _STRICT
    at_s: float = Field(ge=0)
    preempt: list[str] = Field(default_factory=list, description="nodes sent an operator preempt order")
    moment: Literal["now", "chunk_send", "reduced_send", "forward", "backward"] = "now"
    kill: list[str] = Field(default_factory=list, description="nodes SIGKILLed")
    restart_after_s: Optional[float] = Field(default=None, ge=0,
                                             description="restart the preempted or killed nodes this long after they died")
    link: Optional[dict[str, LinkModel]] = Field(default=None, description="new links, by host")


class ChurnModel(BaseModel):
    """Every `every_s`, SIGKILL `fraction` of the workers (at least one) and restart them after
    `restart_after_s` with the same identity."""

    model_config = _STRICT
    every_s: float = Field(gt=0)
    fraction: float = Field(gt=0, le=1)
    restart_after_s: float = Field(default=2.0, ge=0)
    start_s: float = Field(default=30.0, ge=0)
    seed: int = 0


class RunModel(BaseModel):
    model_config = _STRICT
    config: str = Field(description="preset name or YAML path (relative to the scenario file)")
    overrides: dict[str, Any] = Field(default_factory=dict)


class Scenario(BaseModel):
    model_config = _STRICT
    name: str
    run: RunModel
    links: dict[str, LinkModel] = Field(default_factory=dict,
                                        description="named links; one named after a role is that role's default")
    nodes: list[NodeModel]
    routers: list[RouterModel] = Field(default_factory=list, description="home routers nodes sit behind")
    duration_s: float = Field(gt=0, description="seconds from the trainers' start to the end")
    warmup_s: float = Field(default=0.0, ge=0, description="tokens/s is measured after this")
    scrape_every_s: float = Field(default=5.0, gt=0)
    measure_links: list[tuple[str, str]] = Field(default_factory=list,
                                                 description="host pairs whose RTT and throughput are measured first")
    measure_seconds: float = Field(default=2.0, gt=0)
    events: list[EventModel] = Field(default_factory=list)
    churn: Optional[ChurnModel] = None
    torch_threads: int = Field(default=1, ge=1)
    announce_period_s: float = Field(default=3.0, gt=0, description="--announce-period-s of every node")
    subnet: str = Field(default="10.77.0.0/16", description="the lab's addresses (two labs at once need two)")

    @model_validator(mode="after")
    def _check(self) -> "Scenario":
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        if [n.role for n in self.nodes].count("authorizer") != 1:
            raise ValueError("a scenario has exactly one authorizer node")
        for node in self.nodes:
            if node.role == "worker" and node.stage is None:
                raise ValueError(f"worker {node.name} needs a stage")
        known = set(names)
        routers = {r.name for r in self.routers}
        if routers & known:
            raise ValueError(f"routers and nodes need different names: {', '.join(sorted(routers & known))}")
        for item in [*self.nodes, *self.routers]:
            if isinstance(item.link, str) and item.link not in self.links:
                raise ValueError(f"{item.name} names link {item.link!r}, which links does not define")
            if item.behind is not None and item.behind not in routers:
                raise ValueError(f"{item.name} sits behind {item.behind!r}, which routers does not define")
            if item.behind is not None and item.link is not None:
                raise ValueError(f"{item.name} sits behind a router: give the router the link")
        for event in self.events:
            for name in [*event.preempt, *event.kill, *(event.link or {})]:
                if name not in known:
                    raise ValueError(f"event at {event.at_s}s names unknown node {name}")
        for a, b in self.measure_links:
            if a not in known | {"controller"} or b not in known | {"controller"}:
                raise ValueError(f"measure_links names unknown host {a} or {b}")
        return self

    def link_of(self, node: Union[NodeModel, RouterModel]) -> LinkModel:
        if isinstance(node.link, LinkModel):
            return node.link
        default = node.role if isinstance(node, NodeModel) else None
        return self.links.get(node.link or default or "") or LinkModel()

    def hosts(self) -> list:
        """The lab's hosts: every node and router, with its link, or the router it sits behind."""
        from node.netlab.topology import HostSpec

        hosts = []
        for item in [*self.routers, *self.nodes]:
            if item.behind is not None:
                hosts.append(HostSpec(item.name, behind=item.behind))
            else:
                link = self.link_of(item)
                hosts.append(HostSpec(item.name, up_mbit=link.up_mbit, down_mbit=link.down_mbit, rtt_ms=link.rtt_ms))
        return hosts


def load_scenario(path: str, overrides: Optional[dict[str, Any]] = None) -> tuple[Scenario, Path]:
    """The scenario in `path`, with top-level `overrides` applied; one-line ConfigError if bad."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"scenario {path}: cannot read it ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"scenario {path}: the top level must be a mapping")
    data = merged(data, overrides or {})
    try:
        return Scenario.model_validate(data), Path(path).resolve().parent
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error.get("loc", ()))
        raise ConfigError(f"scenario {path}: {where}: {error.get('msg')}") from None


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in: nested mappings merge, dotted keys (`links.contributor`)
    address nested fields, anything else replaces."""
    out = dict(base)
    for key, value in overrides.items():
        if "." in key:
            head, rest = key.split(".", 1)
            key, value = head, {rest: value}
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


# -- metrics ------------------------------------------------------------------------------------
def scrape(url: str, timeout_s: float = 3.0) -> dict[str, float]:
    """The samples of one /metrics page as {'name{label="v",...}': value}; {} if unreachable (or
    `url` is "": a node behind NAT)."""
    from prometheus_client.parser import text_string_to_metric_families

    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode()
    except OSError:
        return {}
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                              if k not in ("run", "role", "stage", "peer"))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def _sum(samples: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest for w in want):
            total += value
    return total


def _group_cpu_s(pid: int) -> float:
    """CPU seconds used so far by a node and its descendants (DHT process, p2pd, averager)."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return total


# -- the runner ---------------------------------------------------------------------------------
class ScenarioRunner:
    """Plays a scenario on a fresh lab and returns its result; everything is torn down however
    it ends (the lab's own teardown, then the nodes')."""

    def __init__(self, scenario: Scenario, base_dir: Path, out_dir: str,
                 say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen):
        """`popen` starts each node (subprocess.Popen's signature; see LocalSwarm)."""
        self.scenario = scenario
        self.base_dir = base_dir
        self.out_dir = out_dir
        self.say = say
        self.popen = popen
        self.swarm: Optional[LabSwarm] = None
        self.timeline: list[dict[str, Any]] = []
        self.scrapes: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.deaths: list[dict[str, Any]] = []
        self._t0 = 0.0
        self._lock = threading.Lock()
        self._cpu_seen: dict[str, float] = {}
        self._cpu_total: dict[str, float] = {}
        self._restart_threads: list[threading.Thread] = []
        self._expected_deaths: dict[str, tuple[str, Optional[float]]] = {}
        self._restarts_due: list[tuple[float, str]] = []
        self._trainer_tokens: dict[str, float] = {}
        self.started_at_unix = 0.0

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _note(self, what: str, **fields: Any) -> None:
        with self._lock:
            self.timeline.append({"t_s": round(self._now(), 2), "event": what, **fields})
        self.say(f"[{self._now():6.1f}s] {what} " + " ".join(f"{k}={v}" for k, v in fields.items()))

    def _run_config(self) -> str:
        from protocol.run_config import dump_run_config, load_run_config

        source = self.scenario.run.config
        if not source.isidentifier() and not Path(source).is_absolute() and (self.base_dir / source).exists():
            source = str(self.base_dir / source)
        run_id = f"lab-{self.scenario.name}-{os.getpid()}"[:60]
        cfg = load_run_config(source, {"run_id": run_id, **self.scenario.run.overrides})
        path = os.path.join(self.out_dir, "run.yaml")
        dump_run_config(cfg, path)
        return path

    def run(self) -> dict[str, Any]:
        from node.netlab.topology import Lab

        self._fresh_out_dir()
        sc = self.scenario
        hosts = sc.hosts()
        run_config_path = self._run_config()
        result: dict[str, Any] = {"scenario": sc.name, "nodes": [n.model_dump() for n in sc.nodes]}
        with Lab(hosts, subnet=sc.subnet) as lab:
            self.say(f"lab up: {len(hosts)} hosts (lab {lab.lab_id})")
            result["lab_id"] = lab.lab_id
            result["links"] = [{"a": a, "b": b, **lab.measure(a, b, seconds=sc.measure_seconds)}
                               for a, b in sc.measure_links]
            for link in result["links"]:
                self.say(f"link {link['a']}->{link['b']}: rtt {link['rtt_ms']:.1f} ms (nominal "
                         f"{link['nominal_rtt_ms']}), {link['throughput_mbit']:.1f} Mbit/s (nominal {link['nominal_mbit']})")
            counters_before = lab.counters()
            self.swarm = LabSwarm(lab, self.out_dir, run_config_path, torch_threads=sc.torch_threads,
                                  announce_period_s=sc.announce_period_s, popen=self.popen)
            try:
                result.update(self._play(lab))
            except BaseException:
                self.swarm.stop_all(timeout_s=5)  # interrupted or broken: leave fast, the lab kills the rest
                raise
            else:
                self.swarm.stop_all()
                result["traffic"] = _traffic(counters_before, lab.counters(), result.get("measured_s", 0.0))
        result["summaries"] = self._summaries()
        result["accounting"] = _accounting(result["summaries"])
        result["averaging"] = _averaging(result["summaries"], self.deaths, result.get("stopped_at_unix"))
        from node.netlab.traffic_check import traffic_vs_plan

        result["traffic_vs_plan"] = traffic_vs_plan(result, run_config_path)
        result["timeline"] = self.timeline
        with open(os.path.join(self.out_dir, "result.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        return result

    def _fresh_out_dir(self) -> None:
        """Every node starts from nothing: an earlier run's identities, database and checkpoints
        in the same directory belong to another run id (the authorizer refuses its database). A
        directory with an earlier lab run in it is emptied; any other non-empty one is refused."""
        out = Path(self.out_dir)
        if out.exists() and any(out.iterdir()):
            if not (out / "run.yaml").exists():
                raise ConfigError(f"{out} is not empty and holds no earlier lab run: choose another output directory")
            self.say(f"replacing the earlier run in {out}")
            for entry in out.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        out.mkdir(parents=True, exist_ok=True)

    def _play(self, lab) -> dict[str, Any]:
        sc, swarm = self.scenario, self.swarm
        workers = [n for n in sc.nodes if n.role == "worker"]
        from protocol.run_config import load_run_config

        num_stages = load_run_config(swarm.run_config_path).num_stages
        # one spare slot per stage: a restarted node's stale ticket must not keep it out
        capacity = [sum(1 for w in workers if w.stage == s) + 1 for s in range(num_stages)]
        auth = next(n for n in sc.nodes if n.role == "authorizer")
        self._t0 = time.monotonic()
        swarm.start_authorizer(NodeSpec(auth.name, "authorizer", args=auth.args), stage_capacity=capacity)
        self._note("authorizer ready", url=swarm.authorizer.url)
        for node in (n for n in sc.nodes if n.role == "relay"):  # before the nodes: they learn relays at admission
            swarm.start_relay(NodeSpec(node.name, "relay", args=node.args))
            self._note("relay ready", node=node.name)
        # the first worker founds the DHT; the rest join through it (in parallel: admission is the slow part)
        ordered = sorted(workers, key=lambda n: (not n.reducer, n.stage))
        swarm.start_node(NodeSpec(ordered[0].name, "worker", ordered[0].stage, ordered[0].reducer, ordered[0].args))
        for node in ordered[1:]:
            swarm.start_node(NodeSpec(node.name, "worker", node.stage, node.reducer, node.args), wait_ready=False)
        for node in ordered[1:]:
            swarm.local.wait_ready(swarm.processes[node.name], timeout_s=180)
        self._note("workers ready", count=len(workers))
        for node in (n for n in sc.nodes if n.role == "trainer"):
            swarm.start_node(NodeSpec(node.name, "trainer", None, False, node.args))
        self._t0 = time.monotonic()
        self.started_at_unix = time.time()
        self._note("trainers started")
        for name, process in list(swarm.processes.items()):
            self._cpu_seen[name] = _group_cpu_s(process.pid)
        pending = sorted(sc.events, key=lambda e: e.at_s)
        restarts = self._restarts_due
        churn_next = sc.churn.start_s if sc.churn else float("inf")
        rng = random.Random(sc.churn.seed if sc.churn else 0)
        next_scrape = 0.0
        tokens_at_warmup: Optional[float] = None
        while self._now() < sc.duration_s:
            now = self._now()
            if now >= next_scrape:
                snapshot = self._scrape(lab)
                if tokens_at_warmup is None and now >= sc.warmup_s:
                    tokens_at_warmup, warm_t = snapshot["tokens"], now
                next_scrape = now + sc.scrape_every_s
            while pending and pending[0].at_s <= now:
                restarts.extend(self._apply(pending.pop(0)))
            if now >= churn_next:
                restarts.extend(self._churn(rng))
                churn_next += sc.churn.every_s
            for due, name in [r for r in restarts if r[0] <= now]:
                restarts.remove((due, name))
                thread = threading.Thread(target=self._restart, args=(name,), name=f"restart-{name}", daemon=True)
                thread.start()
                self._restart_threads.append(thread)
            self._check_deaths()
            time.sleep(0.2)
        for thread in self._restart_threads:
            thread.join(timeout=5)
        final = self._scrape(lab)
        measured_s = self._now() - (warm_t if tokens_at_warmup is not None else 0.0)
        tokens = final["tokens"] - (tokens_at_warmup or 0.0)
        self._collect_cpu()
        return {"started_at_unix": self.started_at_unix, "stopped_at_unix": time.time(),
                "measured_s": round(measured_s, 2), "tokens_per_s": round(tokens / max(measured_s, 1e-9), 2),
                "restarts": self.restarts, "deaths": self.deaths, "scrapes": self.scrapes,
                "never_died": sorted(self._expected_deaths),
                "cpu_percent": {name: round(100 * s / max(self._now(), 1e-9), 1) for name, s in self._cpu_total.items()}}

    # -- events -----------------------------------------------------------------------------------
    def _apply(self, event: EventModel) -> list[tuple[float, str]]:
        restarts = []
        for host, link in (event.link or {}).items():
            self.scenario_link_change(host, link)
        if event.preempt:
            # the orders take seconds to write, and the nodes die at their moment: watched by the main loop
            threading.Thread(target=self._preempt, args=(event.preempt, event.moment, event.restart_after_s),
                             name="preempt", daemon=True).start()
        for name in event.kill:
            self._collect_cpu(name)
            self.swarm.kill(name)
            self.deaths.append({"node": name, "t_s": round(self._now(), 2), "how": "sigkill"})
            self._note("killed", node=name)
        if event.restart_after_s is not None:
            for name in event.kill:
                restarts.append((self._now() + event.restart_after_s, name))
        return restarts

    def scenario_link_change(self, host: str, link: LinkModel) -> None:
        self.swarm.lab.set_link(host, up_mbit=link.up_mbit, down_mbit=link.down_mbit, rtt_ms=link.rtt_ms)
        self._note("link changed", host=host, **link.model_dump())

    def _preempt(self, names: list[str], moment: str, restart_after_s: Optional[float]) -> None:
        """Send each node an operator preempt order with the real CLI, from the controller, all at
        once (each CLI joins the run as a temporary node, which takes seconds)."""
        swarm = self.swarm
        peers = [swarm.processes[name].peer_id for name in names]
        argv = [sys.executable, "-m", "node.cli", "preempt", "--authorizer", swarm.authorizer.url,
                "--admin-token", swarm.admin_token, "--peer", *peers, "--at", moment, "--timeout-s", "120",
                # the orders' writer joins the DHT from the controller, which the lab routes to every host
                "--host-maddrs", f"/ip4/{swarm.lab.address('controller')}/tcp/0"]
        if swarm.bootstrap:
            argv += ["--initial-peers", *swarm.bootstrap]
        for name in names:
            self._watch_for_death(name, "preempted", restart_after_s)
        sent = self._now()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        self._note("preempt orders written", nodes=",".join(names), moment=moment, exit=proc.returncode,
                   took_s=round(self._now() - sent, 1), said=(out or err).strip().splitlines()[-1:] or "")

    def _watch_for_death(self, name: str, how: str, restart_after_s: Optional[float]) -> None:
        with self._lock:
            self._expected_deaths[name] = (how, restart_after_s)

    def _check_deaths(self) -> None:
        with self._lock:
            expected = dict(self._expected_deaths)
        for name, (how, restart_after_s) in expected.items():
            if not self.swarm.alive(name):
                with self._lock:
                    del self._expected_deaths[name]
                if restart_after_s is not None:
                    self._restarts_due.append((self._now() + restart_after_s, name))
                self._collect_cpu(name)
                code = self.swarm.processes[name].proc.returncode
                self.deaths.append({"node": name, "t_s": round(self._now(), 2), "how": how, "exit": code})
                self._note(how, node=name, exit=code)

    def _churn(self, rng: random.Random) -> list[tuple[float, str]]:
        churn = self.scenario.churn
        live = [n.name for n in self.scenario.nodes if n.role == "worker" and self.swarm.alive(n.name)]
        if not live:
            return []
        count = max(1, round(churn.fraction * len(live)))
        victims = rng.sample(live, min(count, len(live)))
        for name in victims:
            self._collect_cpu(name)
            self.swarm.kill(name)
            self.deaths.append({"node": name, "t_s": round(self._now(), 2), "how": "churn"})
        self._note("churn killed", nodes=",".join(victims))
        return [(self._now() + churn.restart_after_s, name) for name in victims]

    def _restart(self, name: str) -> None:
        if self.swarm.alive(name):
            self.swarm.kill(name)
        started = self._now()
        try:
            node, ready_s = self.swarm.restart(name)
        except Exception as exc:  # noqa: BLE001 - a restart that fails is a result, not a crash
            self.restarts.append({"node": name, "t_s": round(started, 2), "ready_s": None, "error": str(exc)[:300]})
            self._note("restart failed", node=name, error=str(exc).splitlines()[0][:120])
            return
        self._cpu_seen[name] = _group_cpu_s(node.pid)
        serving_s = self._wait_serving(name, started, node)
        self.restarts.append({"node": name, "t_s": round(started, 2), "ready_s": round(ready_s, 2),
                              "serving_s": serving_s, "killed_before_serving": serving_s is None and node.proc.poll() is not None})
        self._note("restarted", node=name, ready_s=round(ready_s, 1), serving_s=serving_s)

    def _wait_serving(self, name: str, started: float, node, timeout_s: float = 90.0) -> Optional[float]:
        """Seconds from the restart until the node's worker has served a request again (its
        forward counter moves), or None if it did not within `timeout_s` or the process restarted
        died first (churn may kill it again; the next process answers on the same address, and its
        serving must not count for this restart)."""
        url = self.swarm.metrics_url(name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and node.proc.poll() is None:
            served = _sum(scrape(url), "agora_worker_requests_total", outcome="ok")
            if served > 0:
                return round(self._now() - started, 2)
            time.sleep(0.5)
        return None

    # -- observation ------------------------------------------------------------------------------
    def _scrape(self, lab) -> dict[str, Any]:
        snapshot: dict[str, Any] = {"t_s": round(self._now(), 2), "nodes": {}, "tokens": 0.0}
        behind_nat = {n.name for n in self.scenario.nodes if n.behind is not None}
        for name, node in list(self.swarm.processes.items()):
            # a node behind NAT cannot be reached from the controller (and its LAN address must
            # not be sent to the machine's own default route)
            if node.role == "authorizer" or node.proc.poll() is not None or name in behind_nat:
                continue
            samples = scrape(self.swarm.metrics_url(name))
            keep = {k: v for k, v in samples.items() if k.startswith(("agora_bytes", "agora_trainer_tokens_total",
                                                                       "agora_relayed_bytes", "libp2p_relaysvc_",
                                                                       "agora_trainer_samples_total",
                                                                       "agora_averaging_rounds_total",
                                                                       "agora_trainer_loss"))}
            snapshot["nodes"][name] = keep
        # tokens are summed from trainers' counters, which restart with a trainer: keep the max seen
        for name, node in list(self.swarm.processes.items()):
            if node.role == "trainer":
                tokens = _sum(snapshot["nodes"].get(name, {}), "agora_trainer_tokens_total")
                self._trainer_tokens[name] = max(tokens, self._trainer_tokens.get(name, 0.0))
        snapshot["tokens"] = sum(self._trainer_tokens.values())
        self.scrapes.append(snapshot)
        return snapshot

    def _collect_cpu(self, name: Optional[str] = None) -> None:
        names = [name] if name else list(self.swarm.processes)
        for n in names:
            process = self.swarm.processes.get(n)
            if process is None or process.proc.poll() is not None:
                continue
            used = _group_cpu_s(process.pid) - self._cpu_seen.get(n, 0.0)
            self._cpu_total[n] = self._cpu_total.get(n, 0.0) + max(0.0, used)
            self._cpu_seen[n] = _group_cpu_s(process.pid)

    def _summaries(self) -> list[dict[str, Any]]:
        out = []
        for node in self.swarm.local.nodes:
            out.append({"name": node.name, "role": node.role, "stage": node.stage, "exit": node.proc.returncode,
                        "peer": node.peer_id, "summary": _last_json(node.stdout_lines)})
        return out


def _last_json(lines: list[str]) -> Optional[dict]:
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line).get("summary")
            except json.JSONDecodeError:
                continue
    return None


def _traffic(before: dict[str, dict], after: dict[str, dict], seconds: float) -> dict[str, Any]:
    out = {}
    for host, counters in after.items():
        start = before.get(host, {})
        delta = {k: v - start.get(k, 0) for k, v in counters.items() if isinstance(v, (int, float))}
        out[host] = delta
    return out


def _accounting(summaries: list[dict]) -> dict[str, Any]:
    """Every trainer's samples: started = completed + dropped + in flight, summed over incarnations."""
    totals = {"samples_started": 0, "samples_completed": 0, "samples_dropped": 0, "samples_in_flight": 0,
              "dropped_by_reason": {}, "trainers_without_summary": 0}
    for item in summaries:
        if item["role"] != "trainer":
            continue
        summary = item["summary"]
        if not summary:
            totals["trainers_without_summary"] += 1
            continue
        for key in ("samples_started", "samples_completed", "samples_dropped", "samples_in_flight"):
            totals[key] += int(summary.get(key, 0))
        for reason, count in (summary.get("dropped_by_reason") or {}).items():
            totals["dropped_by_reason"][reason] = totals["dropped_by_reason"].get(reason, 0) + count
    totals["unaccounted"] = (totals["samples_started"] - totals["samples_completed"] - totals["samples_dropped"]
                             - totals["samples_in_flight"])
    return totals


def _averaging(summaries: list[dict], deaths: list[dict], stopped_at: Optional[float] = None) -> dict[str, Any]:
    """Rounds as the workers that printed a summary saw them, counted as the report does [3.5.2.2]:
    a round failed when its completeness (the share of reduced chunks this peer got back) is below
    100%, a round where this peer found no group included. `completeness_mean` is over the rounds
    whose all-reduce ran (the report's "partial all-reduce completeness"); `completeness_mean_all`
    counts the rounds without a group as 0. A round whose lost slices the survivors averaged again
    at once (a `repair` round, averaging/service.py) counts what the repair brought back:
    completeness a + (1 - a) * repair's; `*_before_repair` leaves repairs out. A round that was
    not complete and ended after the scenario's stop (`stopped_at`, unix time) was cut by the
    nodes' shutdown: it is counted as `cut_by_stop`, not judged."""
    rounds, repairs, cut = [], {}, 0
    for item in summaries:
        summary = item["summary"] or {}
        for record in (summary.get("averaging") or {}).get("rounds", []):
            if record.get("status") == "skipped":
                continue
            if record.get("kind") == "repair":
                repairs[(item["name"], record.get("round"))] = record
                continue
            if stopped_at and record.get("status") != "complete" and (record.get("finished_at") or 0) > stopped_at:
                cut += 1
                continue
            rounds.append({"node": item["name"], "stage": item["stage"], **record})
    for r in rounds:
        repair = repairs.get((r["node"], r.get("round")))
        own = r["averaging_success"] if r.get("averaging_success") is not None else 0.0
        r["averaging_success_before_repair"] = own
        if repair is not None:
            r["repair_status"] = repair.get("status")
            r["averaging_success"] = round(own + (1 - own) * (repair.get("averaging_success") or 0.0), 6)
            if r["averaging_success"] >= 1.0 and r["status"] == "partial" and repair.get("status") == "complete":
                r["status"] = "complete"
    ran = len(rounds)
    completeness = [r["averaging_success"] if r.get("averaging_success") is not None else 0.0 for r in rounds]
    before = [r["averaging_success_before_repair"] for r in rounds if (r.get("group_size") or 0) >= 1]
    failed = sum(1 for c in completeness if c < 1.0)
    allreduced = [c for r, c in zip(rounds, completeness) if (r.get("group_size") or 0) >= 1]
    durations = [r["duration_s"] for r in rounds]
    return {
        "rounds": ran,
        "by_status": {s: sum(1 for r in rounds if r["status"] == s) for s in ("complete", "partial", "failed")},
        "no_group": ran - len(allreduced),
        "cut_by_stop": cut,
        "failed_pct": round(100.0 * failed / ran, 2) if ran else None,
        "completeness_mean": round(sum(allreduced) / len(allreduced), 4) if allreduced else None,
        "completeness_min": round(min(allreduced), 4) if allreduced else None,
        "completeness_mean_all": round(sum(completeness) / ran, 4) if ran else None,
        "completeness_mean_before_repair": round(sum(before) / len(before), 4) if before else None,
        "repairs": {s: sum(1 for r in repairs.values() if r.get("status") == s) for s in ("complete", "partial", "failed")},
        "duration_mean_s": round(sum(durations) / ran, 2) if ran else None,
        "duration_max_s": round(max(durations), 2) if ran else None,
        "detail": [{k: r.get(k) for k in ("node", "stage", "round", "status", "averaging_success",
                                          "averaging_success_before_repair", "repair_status", "reduce_success",
                                          "duration_s", "group_size", "expected_group_size", "finished_at",
                                          "failure_reason")} for r in rounds],
    }
