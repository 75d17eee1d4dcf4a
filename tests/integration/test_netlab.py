"""The network lab on this machine: real namespaces, TUN devices and the switch (node/netlab).
Needs root and /dev/net/tun; skipped with the reason otherwise."""

from __future__ import annotations

import ipaddress
import json
import os
import select
import signal
import subprocess
import sys

import psutil
import pytest

from node.netlab.cleanup import cleanup_stale, list_netns, list_root_devices, state_path, switch_processes
from node.netlab.plan import lab_id_of
from node.netlab.topology import HostSpec, Lab
from tests.support.polling import poll_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the network lab needs root (namespaces, TUN, tc)"),
    pytest.mark.skipif(not os.path.exists("/dev/net/tun"), reason="the network lab needs /dev/net/tun"),
    pytest.mark.timeout(60),
]


def _free_subnet() -> str:
    """A /16 nobody routes here, so this test can run beside another lab (the default 10.77/16)."""
    routes = json.loads(subprocess.run(["ip", "-j", "-4", "route", "show", "table", "all"], capture_output=True,
                                       text=True).stdout or "[]")
    used = [ipaddress.IPv4Network(r["dst"] if "/" in r["dst"] else r["dst"] + "/32", strict=False)
            for r in routes if r.get("dst") not in (None, "default")]
    for second in range(180, 250):
        candidate = ipaddress.IPv4Network(f"10.{second}.0.0/16")
        if not any(candidate.overlaps(u) for u in used):
            return str(candidate)
    pytest.skip("no free 10.x.0.0/16 for the lab")


def _leftovers(lab_id: str) -> list[str]:
    found = [f"netns {n}" for n in list_netns() if lab_id_of("agl", n) == lab_id]
    found += [f"device {d}" for d in list_root_devices() if lab_id_of("agl", d) == lab_id]
    found += [f"switch {pid}" for pid, owner in switch_processes().items() if owner == lab_id]
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    found += [f"qdisc {line}" for line in qdiscs.splitlines() if f"agl-{lab_id}" in line]
    if os.path.exists(state_path(lab_id)):
        found.append(f"state {state_path(lab_id)}")
    return found


def _within(measured: float, nominal: float, tolerance: float = 0.2) -> bool:
    return abs(measured - nominal) <= tolerance * nominal


def test_lab_shapes_links_runs_processes_and_leaves_nothing():
    # 30 Mbit/s, not more: the switch is a Python process sharing two cores with the other test
    # worker, and at 100 Mbit/s CI measured 58 (CPU-starved, not mis-shaped)
    shaped, plain = HostSpec("s", up_mbit=30, down_mbit=30, rtt_ms=40), HostSpec("u")
    lab = Lab([shaped, plain], subnet=_free_subnet())
    with lab:
        upload = lab.measure("s", "u", seconds=2)  # s's tbf upload, 40 ms
        download = lab.measure("controller", "s", seconds=2)  # s's download queue in the switch
        for result in (upload, download):
            assert _within(result["rtt_ms"], 40), result
            assert _within(result["throughput_mbit"], 30), result
        plain_rtt = lab.measure("u", "controller", seconds=0.5)["rtt_ms"]
        assert plain_rtt < 5, f"an unshaped path has {plain_rtt:.1f} ms RTT"

        # a process in one namespace reaches another host through the switch
        server = lab.popen("s", [sys.executable, "-c", (
            "import socket,sys; l=socket.create_server((sys.argv[1], 7001)); print('up', flush=True); "
            "c,_=l.accept(); print(c.recv(16).decode(), flush=True); import time; time.sleep(600)"),
            lab.address("s")], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "up"
        client = lab.popen("u", [sys.executable, "-c",
                                 f"import socket; socket.create_connection(('{lab.address('s')}', 7001)).sendall(b'hello')"])
        assert client.wait(timeout=10) == 0
        assert server.stdout.readline().strip() == "hello"
        sleeper = lab.popen("u", ["sleep", "600"])
        counters = lab.counters()
        assert counters["s"]["rx_bytes"] > 5e6 and counters["s"]["tx_bytes"] > 5e6, counters
        assert counters["u"]["drops_unroutable"] == 0
        pids = [server.pid, sleeper.pid, lab._switch.pid]
    lab.stop()  # idempotent
    for pid in pids:
        poll_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                   5, f"process {pid} to be killed at stop()")
    assert _leftovers(lab.lab_id) == []


def _start_cli(tmp_path, subnet: str) -> tuple[subprocess.Popen, str]:
    topology = tmp_path / "topology.yaml"
    topology.write_text(f"subnet: {subnet}\nhosts:\n  - {{name: a, up_mbit: 50, rtt_ms: 20}}\n  - {{name: b}}\n")
    cli = subprocess.Popen([os.path.join(ROOT, "scripts", "netlab"), "up", str(topology)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([cli.stdout], [], [], 60)  # a loaded machine starts Python slowly
    for line in cli.stdout if ready else []:
        if line.startswith("NETLAB-READY "):
            return cli, json.loads(line.split(" ", 1)[1])["lab_id"]
    cli.kill()
    raise AssertionError(f"netlab up did not get ready: {cli.stderr.read()}")


def test_ctrl_c_tears_the_cli_lab_down(tmp_path):
    cli, lab_id = _start_cli(tmp_path, _free_subnet())
    assert _leftovers(lab_id)
    cli.send_signal(signal.SIGINT)
    assert cli.wait(timeout=20) == 130
    assert _leftovers(lab_id) == []


def test_cleanup_stale_removes_a_killed_cli_lab(tmp_path):
    cli, lab_id = _start_cli(tmp_path, _free_subnet())
    cli.kill()
    cli.wait()
    assert any(item.startswith("netns") for item in _leftovers(lab_id))  # the namespaces outlive it
    removed = cleanup_stale()
    assert any(lab_id in item for item in removed), removed
    assert _leftovers(lab_id) == []
