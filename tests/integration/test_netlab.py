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


@pytest.mark.solo  # measures link rates: beside another test's swarm the cores, not the shaping, set them
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


# ---- contributors behind NAT, through the run's relays (issue 22) ----
# In this file, not test_relays.py: test files run two at a time, and two labs' switches on the
# machine's two cores at once starve the shaping measurement above.

import re  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402


from node.netlab.errors import LabUnavailable  # noqa: E402
from node.netlab.nodes import LabSwarm, NodeSpec  # noqa: E402
from protocol.relays import relay_peers  # noqa: E402

from tests.integration.test_relays import _log as _node_log, _run_config as _relay_run_config  # noqa: E402

SAMPLES = 240


def _hosts() -> list[HostSpec]:
    home = dict(up_mbit=50, down_mbit=200, rtt_ms=20)
    return [HostSpec("auth"), HostSpec("ra"), HostSpec("rb"), HostSpec("w0"), HostSpec("w1"), HostSpec("t0"),
            HostSpec("home", **home), HostSpec("w1home", behind="home"),
            HostSpec("cgn", **home), HostSpec("isp", behind="cgn"), HostSpec("w1cgn", behind="isp")]


@pytest.fixture
def nat_lab():
    if os.geteuid() != 0 or shutil.which("nft") is None:
        pytest.skip("the NAT lab needs root and nftables (scripts/setup installs it)")
    try:
        with Lab(_hosts(), subnet="10.81.0.0/16") as started:
            yield started
    except LabUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.solo
@pytest.mark.timeout(500)
def test_workers_behind_nat_train_and_average_through_the_relays_and_survive_a_relay_dying(nat_lab, tmp_path,
                                                                                         node_popen):
    """Two stage-1 workers behind real masquerading routers (nftables; one behind two levels, a
    stand-in for carrier-grade NAT) that nothing outside can connect to: the authorizer cannot
    dial them back and admits them as relayed; they reserve slots on both of the run's relays,
    train with a public worker and a trainer, and average with the public replica of their stage.
    One relay is killed mid-run: the other carries them on, and every sample is accounted for."""
    swarm = LabSwarm(nat_lab, str(tmp_path), _relay_run_config(tmp_path), popen=node_popen)
    try:
        swarm.start_authorizer(NodeSpec("auth", "authorizer"), stage_capacity=[2, 3])
        swarm.start_relay(NodeSpec("ra", "relay"))
        swarm.start_relay(NodeSpec("rb", "relay"))
        swarm.start_node(NodeSpec("w0", "worker", stage=0))
        swarm.start_node(NodeSpec("w1", "worker", stage=1, reducer=True))
        home = swarm.start_node(NodeSpec("w1home", "worker", stage=1))
        cgn = swarm.start_node(NodeSpec("w1cgn", "worker", stage=1))

        # the authorizer could not dial them back and admitted them as relayed: they announce
        # circuit addresses through both relays, and say so in one line
        for node in (home, cgn):
            assert node.maddrs and all("/p2p-circuit/" in m for m in node.maddrs), node.maddrs
            assert set(relay_peers(node.maddrs)) == {
                swarm.processes["ra"].peer_id, swarm.processes["rb"].peer_id}
            assert "reachable through the run's relays" in _node_log(node)
        assert _node_log(swarm.authorizer).count("admitting it to serve through the run's relays") == 2

        trainer = swarm.start_node(NodeSpec("t0", "trainer", args=["--max-samples", str(SAMPLES), "--lanes", "4",
                                                                    "--progress-log-period-s", "1"]))
        poll_until(lambda: _completed(trainer) >= SAMPLES // 4, 180, "a quarter of the samples before the relay dies")
        killed_at = time.monotonic()
        swarm.kill("ra")
        assert swarm.local.wait(trainer, 300) == 0, trainer.log_tail(60)
        after_kill_s = time.monotonic() - killed_at
        summary = trainer.summary()
        assert summary["samples_started"] == SAMPLES
        assert summary["samples_completed"] + summary["samples_dropped"] == SAMPLES  # every sample accounted
        assert summary["samples_dropped"] == 0, summary["dropped_by_reason"]
        served = summary["served"]["1"]
        assert served.get(home.peer_id, 0) > 0 and served.get(cgn.peer_id, 0) > 0, served
        print(f"relay killed; the run finished {after_kill_s:.1f} s later; stage 1 served {served}")
        # The relayed replicas average with the public one, now through the surviving relay. The
        # run above can be over in seconds on a quiet machine, before the last joiner's first
        # round; the stage goes on averaging on its clock while idle, so wait for that.
        for node in (home, cgn):
            poll_until(lambda node=node: AVERAGED.search(_node_log(node)), 120,
                       f"{node.name}: an averaging round with the stage's other replicas")
    finally:
        swarm.stop_all()
    # ...and their exit summaries list those rounds
    for node in (home, cgn):
        rounds = (node.summary() or {}).get("averaging", {}).get("rounds", [])
        assert any(r.get("status") in ("complete", "partial") and r.get("group_size", 0) >= 2 for r in rounds), \
            rounds[-3:]


AVERAGED = re.compile(r"averaging: .*: (complete|partial), group [2-9]")


def _completed(trainer) -> int:
    found = re.findall(r"(\d+) samples completed", _node_log(trainer))
    return int(found[-1]) if found else 0


