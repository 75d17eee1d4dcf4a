"""Contributors behind real home routers, on a lab that looks like the internet (node/netlab/natlab.py):
public-class addresses on the internet side, nftables masquerading routers, one and two levels of
NAT, and only the documented commands.

The run: an authorizer and two relays started as docs/operations.md "Relays" says, a stage-0 and a
stage-2 worker and a trainer on the internet; stage 1 is served only from homes: one worker behind
a router with the short command of docs/contributing-compute.md, and one behind a carrier NAT and a
router listening on 0.0.0.0 (the "Ports" section); a stage-2 worker behind a router that forwards
its port (--announce-maddrs) must come out direct, and one whose router blocks the relays' port
must say so and leave. Needs root and nftables; skipped otherwise."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import time
import uuid

import pytest
import yaml

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="the NAT lab needs root (network namespaces)"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="the NAT lab needs nftables (scripts/setup installs it)"),
]

PORT = 31337
RELAY_PORT = 4001


def _log(node) -> str:
    with open(node.log_path, errors="replace") as f:
        return f.read()


class HomeRun:
    """The lab, its run config and the nodes, started the way the docs tell people to."""

    def __init__(self, lab, workdir: str, popen):
        from node.launcher import LocalSwarm
        from protocol.run_presets import PRESETS

        self.lab = lab
        self.workdir = workdir
        self.token = secrets.token_hex(16)
        config = dict(PRESETS["tiny"])
        config.update(run_id=f"home-{uuid.uuid4().hex[:6]}", evaluation={"every_steps": 0})
        self.config_path = os.path.join(workdir, "run.yaml")
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)
        self.swarm = LocalSwarm(workdir, None, popen=popen)
        self.url = f"http://{lab.addresses['auth']}:8000"

    def authorizer(self):
        address = self.lab.addresses["auth"]
        policy = os.path.join(self.workdir, "policy.yaml")
        with open(policy, "w") as f:
            f.write("honor_stage_preference: true\n")  # stage 1 is the homes' stage
        return self.swarm.start_authorizer(
            ["--run-config", self.config_path, "--data-dir", os.path.join(self.workdir, "auth"), "--host", address,
             "--port", "8000", "--admin-token", self.token, "--policy-file", policy, "--no-monitor"],
            prefix=self.lab.command("auth", []))

    def relay(self, name: str):
        """docs/operations.md "Relays", word for word but for the addresses."""
        return self.swarm.start_relay(
            ["--authorizer", self.url, "--account-token", self.token, "--identity", self._key(name),
             "--host-maddrs", f"/ip4/0.0.0.0/tcp/{RELAY_PORT}",
             "--announce-maddrs", f"/ip4/{self.lab.addresses[name]}/tcp/{RELAY_PORT}"],
            name=name, prefix=self.lab.command(name, []))

    def worker(self, name: str, *extra: str, stage=None, incarnation: int = 0, **kwargs):
        args = ["--authorizer", self.url, "--identity", self._key(name), *extra]
        if stage is not None:
            args += ["--stage", str(stage)]
        label = name if incarnation == 0 else f"{name}.{incarnation}"
        return self.swarm.start("worker", args=args, name=label, prefix=self.lab.command(name, []), **kwargs)

    def trainer(self, name: str, samples: int, incarnation: int = 0):
        args = ["--authorizer", self.url, "--identity", self._key(name), "--max-samples", str(samples),
                "--host-maddrs", f"/ip4/{self.lab.addresses[name]}/tcp/{PORT}"]
        label = name if incarnation == 0 else f"{name}.{incarnation}"
        return self.swarm.start("trainer", args=args, name=label, prefix=self.lab.command(name, []))

    def _key(self, name: str) -> str:
        return os.path.join(self.workdir, f"{name}.key")


@pytest.fixture
def home_lab(tmp_path, node_popen):
    from node.netlab.cleanup import cleanup_stale
    from node.netlab.natlab import PREFIX, NatLab, Site

    cleanup_stale(PREFIX)  # what a killed earlier run left (its owner is gone)
    sites = [Site("auth"), Site("ra"), Site("rb"), Site("w0"), Site("w2"), Site("t0"),
             Site("home1", router=True), Site("w1a", behind="home1"),
             Site("cgn", router=True, carrier=True), Site("home2", router=True, behind="cgn"),
             Site("w1b", behind="home2"),
             Site("home3", router=True), Site("w1c", behind="home3"),
             Site("home4", router=True), Site("w1d", behind="home4")]
    with NatLab(sites) as lab:
        run = HomeRun(lab, str(tmp_path), node_popen)
        try:
            yield run
        finally:
            run.swarm.stop_all(timeout_s=20)


@pytest.mark.timeout(600)
def test_home_workers_join_serve_restart_and_survive_a_relay(home_lab):
    run = home_lab
    lab = run.lab
    assert not lab.addresses["ra"].startswith(("10.", "192.168.", "172.")), "the internet side must be public-class"
    run.authorizer()
    # before the run has a relay: refused, with advice that works behind a router
    refused = run.worker("w1a", "--host-maddrs", f"/ip4/0.0.0.0/tcp/{PORT}", stage=1, wait_ready=False)
    assert run.swarm.wait(refused, 90) == 4, refused.log_tail()
    advice = _log(refused)
    assert f"forward TCP port {PORT} on that router" in advice and lab.public_address("w1a") in advice, advice
    assert "ask the run's owner to run a relay" in advice and "Traceback" not in advice, advice
    relays = [run.relay("ra"), run.relay("rb")]
    for name, stage in (("w0", 0), ("w2", 2)):
        run.worker(name, "--host-maddrs", f"/ip4/0.0.0.0/tcp/{PORT}",
                   "--announce-maddrs", f"/ip4/{lab.addresses[name]}/tcp/{PORT}", stage=stage)
    lab.forward_port("home3", PORT, "w1c")
    began = time.monotonic()
    home = {
        # the short command: no --host-maddrs (127.0.0.1 only), behind one router
        "w1a": run.worker("w1a", stage=1, incarnation=1),
        # listening on every interface behind a carrier NAT and a router
        "w1b": run.worker("w1b", "--host-maddrs", f"/ip4/0.0.0.0/tcp/{PORT}", stage=1),
        # a forwarded port, announced at the router's public address (beside the public stage-2 worker)
        "w1c": run.worker("w1c", "--host-maddrs", f"/ip4/0.0.0.0/tcp/{PORT}",
                          "--announce-maddrs", f"/ip4/{lab.public_address('w1c')}/tcp/{PORT}", stage=2),
    }
    ready_s = time.monotonic() - began
    # a router that lets nothing out to the relays' port: no slot anywhere, said in one line
    lab.block_port("home4", RELAY_PORT)
    cut_off = run.worker("w1d", "--relay-slot-timeout-s", "8", stage=1, wait_ready=False)
    assert run.swarm.wait(cut_off, 90) == 2, cut_off.log_tail()
    log = _log(cut_off)
    assert "waiting for a slot on the run's relays: none of 2 carries this node yet" in log, log[-3000:]
    assert "agora-node: error: no relay of the run gave this node a slot within 8 s" in log, log[-3000:]
    assert "left the run at the authorizer" in log and "Traceback" not in log, log[-3000:]
    for name in ("w1a", "w1b"):
        log = _log(home[name])
        assert "reachable through the run's relays" in log, log[-3000:]
        assert "a relay of the run carries this node (checked through a circuit" in log, log[-3000:]
        assert all("/p2p-circuit/" in m for m in home[name].maddrs), home[name].maddrs
        assert "Traceback" not in log, log[-3000:]
    assert "reachable directly at" in _log(home["w1c"]), _log(home["w1c"])[-3000:]
    assert home["w1c"].maddrs[0].startswith(f"/ip4/{lab.public_address('w1c')}/tcp/{PORT}/"), home["w1c"].maddrs
    assert ready_s < 120, ready_s

    # training through them; a relay dies mid-run
    trainer = run.trainer("t0", 400)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "training starts" not in _log(trainer):
        time.sleep(0.5)
    time.sleep(5)  # some samples through the relays first
    run.swarm.stop(relays[0], sig=signal.SIGKILL, timeout_s=5)
    assert run.swarm.wait(trainer, 240) == 0, trainer.log_tail(40)
    summary = trainer.summary()
    assert summary["samples_completed"] == 400 and summary["samples_dropped"] == 0, summary
    assert summary["samples_skipping_a_stage"] == 0, summary  # stage 1 was never routed around
    served = summary["served"]["1"]
    stage_total = sum(served.values())
    for name in ("w1a", "w1b"):
        share = served.get(home[name].peer_id, 0) / stage_total
        assert share >= 0.2, (name, served)
    served_2 = summary["served"]["2"].get(home["w1c"].peer_id, 0)
    assert served_2 > 0, summary["served"]

    # the home worker behind one router, killed and restarted with its identity, serves again
    run.swarm.stop(home["w1a"], sig=signal.SIGKILL, timeout_s=5)
    began = time.monotonic()
    again = run.worker("w1a", stage=1, incarnation=2)
    restart_s = time.monotonic() - began
    assert "reachable through the run's relays" in _log(again), _log(again)[-3000:]
    trainer = run.trainer("t0", 120, incarnation=1)
    assert run.swarm.wait(trainer, 240) == 0, trainer.log_tail(40)
    summary = trainer.summary()
    assert summary["samples_completed"] == 120 and summary["samples_dropped"] == 0, summary
    assert summary["served"]["1"].get(again.peer_id, 0) > 0, summary["served"]
    assert restart_s < 60, restart_s
    print(f"home workers ready in {ready_s:.1f} s (three, one after another); stage 1 shares "
          f"{ {n: round(served.get(home[n].peer_id, 0) / stage_total, 3) for n in ('w1a', 'w1b')} }; stage 2 "
          f"served {served_2} by the forwarded port; restarted home worker "
          f"ready in {restart_s:.1f} s, served {summary['served']['1'].get(again.peer_id, 0)} of 120 afterwards")

