"""The Lab: real processes in network namespaces behind residential-style links.

Each host is one namespace whose only interface besides `lo` is a TUN device; the root namespace
gets one too (the "controller" host, unshaped), so the runner reaches every node directly. A
switch process (node/netlab/switch.py) holds every TUN and moves packets between them with each
path's delay and each host's download rate; a host's upload rate is a tbf qdisc on its TUN
(node/netlab/shaping.py says why each piece sits where it does). Every byte a node sends to
another lab address (pipeline streams, DHT, averaging, HTTP) takes that path. Traffic to
127.0.0.1 stays inside the namespace, unshaped.

What a lab leaves on the machine and how leftovers are removed: node/netlab/cleanup.py.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import psutil

from node.netlab import cleanup
from node.netlab.errors import LabError, LabUnavailable, SubnetInUse
from node.netlab.kernel import set_parent_death_signal
from node.netlab.plan import (CONTROLLER, PREFIX, HostSpec, allocate_addresses, check_link, check_names,
                              device_name, netns_name, new_lab_id, nominal_mbit, nominal_rtt_ms, one_way_delay_s)
from node.netlab.shaping import QUEUE_MS, upload_qdisc

__all__ = ["HostSpec", "Lab", "CONTROLLER"]

MTU = 1500
"""The hosts' MTU. Segmentation offload lets the switch move up to 64 KiB per read anyway, so TCP
keeps internet-sized segments (initial window, loss recovery) at no cost in switch CPU."""

NETNS_SYSCTLS = {
    # A namespace starts with the kernel's defaults; 4 MiB of send buffer cannot keep 200 Mbit/s
    # in flight over 120 ms plus a 100 ms queue (BDP ~5.5 MB).
    "net.ipv4.tcp_rmem": "4096 131072 33554432",
    "net.ipv4.tcp_wmem": "4096 16384 33554432",
    "net.core.rmem_max": "33554432",
    "net.core.wmem_max": "33554432",
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
}

_UNCHANGED: Any = object()
_PYTHONPATH = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = _PYTHONPATH + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _die_with_lab() -> None:
    # runs in the child between fork and exec; only used when forked from the main thread (a
    # parent-death signal fires when the forking *thread* exits)
    set_parent_death_signal(signal.SIGKILL)


class Lab:
    """A set of lab hosts; a context manager whose exit always tears everything down."""

    def __init__(self, hosts: list[HostSpec], *, lab_id: Optional[str] = None, subnet: str = "10.77.0.0/16",
                 prefix: str = PREFIX, queue_ms: float = QUEUE_MS) -> None:
        self.lab_id = lab_id or new_lab_id()
        self.prefix = prefix
        check_names(prefix, self.lab_id)
        self.subnet = subnet
        self.queue_ms = queue_ms
        self.hosts: dict[str, HostSpec] = {h.name: h for h in hosts}
        public = [h.name for h in hosts if h.behind is None]
        self.routers = _routers(self.hosts)
        self.addresses = allocate_addresses(subnet, public)
        self.addresses.update(_lan_addresses(self.hosts, self.routers))
        self.prefixlen = int(subnet.split("/")[1])
        self.device = device_name(prefix, self.lab_id)
        self._order = [CONTROLLER, *public]  # the switch's host indices
        self._switch: Optional[subprocess.Popen] = None
        self._switch_lock = threading.Lock()
        self._processes: list[subprocess.Popen] = []
        self._started = False
        self._stopped = False

    # -- names ---------------------------------------------------------------------------------

    def address(self, host: str) -> str:
        """IPv4 address of `host`; "controller" is the root namespace's."""
        self._known(host)
        return self.addresses[host]

    def netns(self, host: str) -> str:
        self._known(host, controller=False)
        return netns_name(self.prefix, self.lab_id, host)

    def command(self, host: str, argv: list[str]) -> list[str]:
        """`argv` wrapped to run inside the host's namespace (unchanged for the controller)."""
        self._known(host)
        return list(argv) if host == CONTROLLER else ["ip", "netns", "exec", self.netns(host), *argv]

    def _known(self, host: str, *, controller: bool = True) -> None:
        if host == CONTROLLER and controller:
            return
        if host not in self.hosts:
            raise LabError(f"no host {host!r} in this lab; hosts: {', '.join(self.hosts)}")

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> "Lab":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Namespaces, TUN devices, addresses, qdiscs and the switch. Undoes itself on failure."""
        if self._started:
            raise LabError("this Lab was already started; make a new one")
        self._started = True
        _check_machine()
        if self.routers and shutil.which("nft") is None:
            raise LabUnavailable("the lab's home routers need `nft` (Debian package nftables; scripts/setup "
                                 "installs it)")
        self._check_subnet()
        cleanup.write_state(self.lab_id, {"prefix": self.prefix, "subnet": self.subnet, "device": self.device,
                                          "namespaces": [self.netns(h) for h in self.hosts]})
        try:
            for host in self.hosts:
                _run(["ip", "netns", "add", self.netns(host)])
            self._start_switch()
            for host in self._order[1:]:
                self._configure(host)
            for router in self.routers:  # parents before children
                self._configure_router(router)
            # the root namespace keeps IPv6; the controller's device does not need it (the switch
            # moves IPv4 only)
            with open(f"/proc/sys/net/ipv6/conf/{self.device}/disable_ipv6", "w") as f:
                f.write("1")
            _run(["ip", "link", "set", "dev", self.device, "mtu", str(MTU), "up"])
            _run(["ip", "addr", "add", f"{self.addresses[CONTROLLER]}/{self.prefixlen}", "dev", self.device])
        except BaseException:
            self.stop()
            raise

    def _check_subnet(self) -> None:
        import ipaddress
        mine = ipaddress.IPv4Network(self.subnet)
        routes = json.loads(cleanup.run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
        for route in routes:
            dst = route.get("dst", "")
            if dst in ("", "default") or ":" in dst:
                continue
            try:
                theirs = ipaddress.IPv4Network(dst if "/" in dst else dst + "/32", strict=False)
            except ValueError:
                continue
            if theirs.overlaps(mine) and theirs.prefixlen > 0:
                raise SubnetInUse(f"subnet {self.subnet} overlaps {dst} (dev {route.get('dev', '?')}), already routed "
                                  f"here: pass Lab(subnet=...) another one, or run `scripts/netlab down` if it is a "
                                  f"dead lab's")

    def _start_switch(self) -> None:
        config = {"vnet_hdr": True, "hosts": [
            {"name": host, "netns": None if host == CONTROLLER else f"/run/netns/{self.netns(host)}",
             "device": self.device, "address": self.addresses[host], **self._switch_link(host)}
            for host in self._order]}
        self._switch = subprocess.Popen(
            [sys.executable, "-m", "node.netlab.switch", "--parent-pid", str(os.getpid()), "--lab-id", self.lab_id],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_child_env(), start_new_session=True)
        reply = self._ask(config, timeout_s=20)
        if not reply.get("ready"):
            raise LabError(reply.get("error") or f"the lab switch did not start: {reply}")

    def _switch_link(self, host: str) -> dict[str, Any]:
        spec = self.hosts.get(host)
        return {"delay_s": one_way_delay_s(spec.rtt_ms) if spec else 0.0,
                "down_bps": spec.down_mbit * 1e6 if spec and spec.down_mbit else None,
                "queue_s": self.queue_ms / 1000.0}

    def _configure(self, host: str) -> None:
        netns, dev = self.netns(host), self.device
        script = [f"sysctl -q -w {k}='{v}'" for k, v in NETNS_SYSCTLS.items()]
        script += ["ip link set lo up", f"ip link set dev {dev} mtu {MTU} up",
                   f"ip addr add {self.addresses[host]}/{self.prefixlen} dev {dev}"]
        _run(["ip", "netns", "exec", netns, "sh", "-ec", "; ".join(script)])
        self._apply_upload(host)

    def _configure_router(self, router: str) -> None:
        """`router`'s LAN: a bridge with the LAN's first address, a veth to each host behind it,
        forwarding on, and nftables masquerading whatever leaves by its uplink (its TUN, or its own
        veth to the router it sits behind); from outside, only replies get in."""
        netns, lan = self.netns(router), self.routers[router]
        uplink = self.device if self.hosts[router].behind is None else "uplink"
        script = ["sysctl -q -w net.ipv4.ip_forward=1", "ip link add lan type bridge", "ip link set lan up",
                  f"ip addr add {lan.gateway}/24 dev lan"]
        _run(["ip", "netns", "exec", netns, "sh", "-ec", "; ".join(script)])
        for index, child in enumerate(lan.hosts):
            child_ns = self.netns(child)
            _run(["ip", "link", "add", "name", f"lan{index}", "netns", netns, "type", "veth", "peer", "name", "uplink",
                  "netns", child_ns])
            _run(["ip", "netns", "exec", netns, "sh", "-ec", f"ip link set lan{index} master lan; "
                                                              f"ip link set lan{index} up"])
            script = [f"sysctl -q -w {k}='{v}'" for k, v in NETNS_SYSCTLS.items()]
            script += ["ip link set lo up", "ip link set uplink up", f"ip addr add {self.addresses[child]}/24 dev uplink",
                       f"ip route add default via {lan.gateway}"]
            _run(["ip", "netns", "exec", child_ns, "sh", "-ec", "; ".join(script)])
        rules = (f"table ip agora_nat {{\n chain postrouting {{\n  type nat hook postrouting priority 100;\n"
                 f"  oifname \"{uplink}\" masquerade\n }}\n chain forward {{\n"
                 f"  type filter hook forward priority 0; policy drop;\n  ct state established,related accept\n"
                 f"  iifname \"lan\" accept\n }}\n}}\n")
        result = subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=rules, text=True,
                                capture_output=True)
        if result.returncode != 0:
            raise LabError(f"could not set up {router}'s NAT with nftables: {result.stderr.strip()}")

    def _apply_upload(self, host: str) -> None:
        for argv in upload_qdisc(self.device, self.hosts[host].up_mbit, self.queue_ms):
            result = cleanup.run(["ip", "netns", "exec", self.netns(host), *argv])
            if result.returncode != 0 and argv[2] != "del":
                raise LabError(f"could not shape {host}'s upload ({' '.join(argv)}): {result.stderr.strip()}")

    def _ask(self, request: dict[str, Any], *, timeout_s: float = 10.0) -> dict[str, Any]:
        """One request to the switch and its one-line reply."""
        with self._switch_lock:
            switch = self._switch
            if switch is None or switch.poll() is not None:
                raise LabError("the lab switch is not running (it exits when its control pipe closes); "
                               "stop this lab and start a new one")
            switch.stdin.write((json.dumps(request) + "\n").encode())
            switch.stdin.flush()
            ready, _, _ = select.select([switch.stdout], [], [], timeout_s)
            line = switch.stdout.readline() if ready else b""
            if not line:
                raise LabError(f"the lab switch did not answer within {timeout_s:g} s "
                               f"(exit code {switch.poll()}); its errors are on this process's stderr")
            return json.loads(line)

    def stop(self, *, grace_s: float = 1.0) -> None:
        """Kill every process in the lab's namespaces (SIGTERM, then SIGKILL after `grace_s`), stop
        the switch (its TUN devices go with it), delete the namespaces and the state file.
        Idempotent; safe after a failed start."""
        if self._stopped or not self._started:
            return
        self._stopped = True
        for process in self._processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        pids = []
        for host in self.hosts:
            pids += cleanup.netns_pids(self.netns(host))
        pids += [p.pid for p in self._processes if p.poll() is None]
        cleanup.kill_pids(sorted(set(pids)), grace_s=grace_s if pids else 0.0)
        for process in self._processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._switch is not None:
            try:
                self._switch.stdin.close()
            except OSError:
                pass
            try:
                self._switch.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._switch.kill()
                self._switch.wait()
            self._switch.stdout.close()
        cleanup.remove_lab(self.lab_id, self.prefix)

    # -- processes -----------------------------------------------------------------------------

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside the host's namespace, in its own session (process group); it is
        killed at stop(). Started from the main thread it also dies with this process."""
        if not self._started or self._stopped:
            raise LabError("start the lab before starting processes in it")
        kwargs.setdefault("start_new_session", True)
        if threading.current_thread() is threading.main_thread() and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = _die_with_lab
        process = subprocess.Popen(self.command(host, argv), **kwargs)
        self._processes.append(process)
        return process

    # -- shaping -------------------------------------------------------------------------------

    def set_link(self, host: str, *, up_mbit: Any = _UNCHANGED, down_mbit: Any = _UNCHANGED,
                 rtt_ms: Any = _UNCHANGED) -> None:
        """Change a host's shaping while the lab runs; arguments left out keep their value, None
        means unshaped. Packets already in flight keep the delay they were sent with."""
        self._known(host, controller=False)
        old = self.hosts[host]
        if old.behind is not None:
            raise LabError(f"{host} sits behind {old.behind}: change the router's link")
        new = HostSpec(host, up_mbit=old.up_mbit if up_mbit is _UNCHANGED else up_mbit,
                       down_mbit=old.down_mbit if down_mbit is _UNCHANGED else down_mbit,
                       rtt_ms=old.rtt_ms if rtt_ms is _UNCHANGED else float(rtt_ms))
        check_link(up_mbit=new.up_mbit, down_mbit=new.down_mbit, rtt_ms=new.rtt_ms)
        self.hosts[host] = new
        reply = self._ask({"op": "set", "host": self._order.index(host), **self._switch_link(host)})
        if not reply.get("ok"):
            raise LabError(f"the switch refused the new link of {host}: {reply}")
        if new.up_mbit != old.up_mbit:
            self._apply_upload(host)

    # -- observation ---------------------------------------------------------------------------

    def counters(self) -> dict[str, dict]:
        """Per host (the controller included): tx_bytes/tx_packets the host sent into the switch,
        rx_bytes/rx_packets the switch delivered to it (IP bytes; a packet may be a segmentation-
        offload packet of up to 64 KiB), drops_queue (its download queue overflowed),
        drops_upload (its upload tbf dropped), drops_unroutable / drops_write / drops_other, and
        drops (their sum)."""
        reply = self._ask({"op": "counters"})
        out = {}
        for row in reply["counters"]:
            host = row.pop("host")
            row["drops_upload"] = self._upload_drops(host)
            row["drops"] = sum(v for k, v in row.items() if k.startswith("drops_"))
            out[host] = row
        return out

    def _upload_drops(self, host: str) -> int:
        if host == CONTROLLER or self.hosts[host].up_mbit is None:
            return 0
        result = cleanup.run(["tc", "-n", self.netns(host), "-s", "-j", "qdisc", "show", "dev", self.device])
        try:
            return sum(int(q.get("drops", 0)) for q in json.loads(result.stdout or "[]"))
        except ValueError:
            return 0

    def nominal(self, a: str, b: str) -> dict[str, Any]:
        """The link figures a->b should show: RTT and the bulk rate (None = unshaped)."""
        self._known(a)
        self._known(b)
        a_link, b_link = self.hosts.get(self.link_host(a)), self.hosts.get(self.link_host(b))
        return {"nominal_rtt_ms": nominal_rtt_ms(a_link, b_link), "nominal_mbit": nominal_mbit(a_link, b_link)}

    def link_host(self, host: str) -> str:
        """The host whose shaped link `host`'s traffic takes: itself, or the router it sits behind."""
        while host != CONTROLLER and self.hosts[host].behind is not None:
            host = self.hosts[host].behind
        return host

    def measure(self, a: str, b: str, *, seconds: float = 3.0) -> dict[str, Any]:
        """Measure the path a->b with real TCP from inside the namespaces: `rtt_ms` (median round
        trip of 64-byte messages on an idle path), `throughput_mbit` (bulk a->b, TCP start-up
        excluded; `throughput_total_mbit` includes it), the nominal figures, and the switch's CPU
        use during the measurement (`switch_cpu_percent`, of one core)."""
        nominal = self.nominal(a, b)
        python = sys.executable
        server = self.popen(b, [python, "-m", "node.netlab.probe", "serve", "--bind", self.address(b)],
                            stdout=subprocess.PIPE, env=_child_env())
        try:
            ready, _, _ = select.select([server.stdout], [], [], 15)
            line = server.stdout.readline().decode() if ready else ""
            if not line.startswith("PROBE-READY"):
                raise LabError(f"the probe server on {b} did not start (exit code {server.poll()})")
            port = line.split()[1]
            switch = psutil.Process(self._switch.pid)
            cpu0, t0 = sum(switch.cpu_times()[:2]), time.monotonic()
            result = subprocess.run(self.command(a, [python, "-m", "node.netlab.probe", "client", "--host",
                                                     self.address(b), "--port", port, "--seconds", str(seconds)]),
                                    capture_output=True, text=True, env=_child_env(), timeout=seconds + 60)
            cpu = (sum(switch.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0) * 100
            if result.returncode != 0:
                raise LabError(f"the probe {a}->{b} failed: {result.stderr.strip()[-300:]}")
            measured = json.loads(result.stdout)
        finally:
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.wait()
            server.stdout.close()
            self._processes.remove(server)
        return {"a": a, "b": b, **measured, **nominal, "switch_cpu_percent": cpu}


@dataclass(frozen=True)
class _Lan:
    gateway: str
    hosts: list[str]


def _routers(hosts: dict[str, HostSpec]) -> dict[str, _Lan]:
    """Every host others sit behind, parents before children, with its LAN (192.168.N.0/24 for the
    N-th router: inside the namespaces, so it cannot clash with the machine's own networks)."""
    children: dict[str, list[str]] = {}
    for spec in hosts.values():
        if spec.behind is not None:
            if spec.behind not in hosts:
                raise LabError(f"host {spec.name!r} sits behind {spec.behind!r}, which is not a host of this lab")
            children.setdefault(spec.behind, []).append(spec.name)
    order: list[str] = []

    def depth(name: str, seen: tuple = ()) -> int:
        if name in seen:
            raise LabError(f"hosts {' -> '.join((*seen, name))} sit behind each other in a loop")
        behind = hosts[name].behind
        return 0 if behind is None else 1 + depth(behind, (*seen, name))

    order = sorted(children, key=lambda name: (depth(name), list(hosts).index(name)))
    if len(order) > 250:
        raise LabError("a lab has room for 250 routers")
    return {name: _Lan(gateway=f"192.168.{index + 1}.1", hosts=children[name]) for index, name in enumerate(order)}


def _lan_addresses(hosts: dict[str, HostSpec], routers: dict[str, _Lan]) -> dict[str, str]:
    addresses = {}
    for lan in routers.values():
        prefix = lan.gateway.rsplit(".", 1)[0]
        for index, child in enumerate(lan.hosts):
            addresses[child] = f"{prefix}.{index + 2}"
    return addresses


def _check_machine() -> None:
    if os.geteuid() != 0:
        raise LabUnavailable("the network lab needs root (network namespaces, TUN devices, tc); run it as root")
    if not os.path.exists("/dev/net/tun"):
        raise LabUnavailable("the network lab needs /dev/net/tun (the tun kernel module); load it or run elsewhere")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LabUnavailable(f"the network lab needs `{tool}` from iproute2; install iproute2")


def _run(argv: list[str]) -> None:
    result = cleanup.run(argv)
    if result.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.stdout.strip()}")
