"""Multi-donor state download: the join time of a `surrogate-1b` body stage (stage 1)
from 1, 2 and 4 donors on 100 Mbit/s links, and the time to finish when a donor dies mid-transfer.
Prints ONE JSON object on stdout (logs go to stderr).

What runs: the product's own donor (roles/worker/state/state_donor.py) behind the product's RPC server on
real libp2p daemons (one p2pd per donor and one for the joiner, over 127.0.0.1), and the product's
joiner path (donor_client.fetch_manifests + choose, state_download.MultiDonorDownload, thaw and
apply_state into a fresh StageOptimizer), on the real state of a surrogate-1b body stage after one
optimizer step (parameters, payload and AdamW moments). The join time is from the first manifest
request to the state applied, so it includes the donors freezing and hashing their snapshots.

The links: by default they are emulated in the application: each donor's uplink is its own upload
token bucket at min(link, donor cap), and the joiner's downlink is one token bucket over every byte
it receives. With `--lab` (root) they are real: every p2pd runs in its own network-lab namespace
(node/netlab) behind a link shaped in the kernel (upload: tbf) and by the lab's switch (download
and `--rtt-ms`); the donors keep only the product's own cap. `--donor-cap-mbps` is the run
config's `sync.donor_upload_mbps` (default 50: half the link, so donating never starves a donor's
own training); the "uncapped" series lets a donor give joiners its whole link.

A dying donor's p2p daemon is shut down when a quarter of the chunks have arrived (its streams reset,
as when its process is killed); the remaining chunks are re-queued to the others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _bench_common import log, machine_info  # noqa: E402


def build_state(preset: str, stage: int):
    import torch

    from protocol.run_config import RunConfig
    from protocol.run_presets import PRESETS
    from roles.model.stage import build_stage_model
    from roles.worker.layout import FlatLayout
    from roles.worker.steps.optimizer import StageOptimizer

    run = RunConfig.model_validate(PRESETS[preset])

    def fresh():
        model = build_stage_model(run, stage, device=torch.device("cpu"))
        opt = StageOptimizer.for_stage(run, stage, model.trainable_parameters(), torch.device("cpu"),
                                       payload=[t for _, t in model.averaged_payload()])
        return model, opt, FlatLayout.of_stage(model)

    model, opt, layout = fresh()
    for p in model.trainable_parameters():
        p.grad = torch.randn_like(p)
    opt.add_samples(1)
    opt.step()
    return run, opt, layout, fresh


class Downlink:
    """The joiner's link: every chunk's bytes pass one shared token bucket."""

    def __init__(self, source, bucket):
        self.source, self.bucket, self.name = source, bucket, source.name

    async def chunk(self, index: int) -> bytes:
        data = await self.source.chunk(index)
        await self.bucket.take(len(data))
        return data


_netns: list[str] = []
"""With --lab: the namespace the next P2P.create starts its p2pd in (set by `_p2p_in`)."""


def _run_daemons_in_namespaces() -> None:
    """Have every p2pd this process starts run inside the namespace `_p2p_in` names: the Python
    side talks to it over its unix socket, which no network namespace separates."""
    from hivemind.p2p import P2P

    original = P2P._make_process_args

    def make_process_args(*args, **kwargs):
        argv = original(*args, **kwargs)
        return ["ip", "netns", "exec", _netns[-1], *argv] if _netns else argv

    P2P._make_process_args = staticmethod(make_process_args)


async def _p2p_in(lab, host: str | None):
    from hivemind.p2p import P2P

    if lab is None:
        return await P2P.create()
    _netns.append(lab.netns(host))
    try:
        return await P2P.create(host_maddrs=[f"/ip4/{lab.address(host)}/tcp/0"])
    finally:
        _netns.pop()


async def scenario(opt, layout, fresh, *, donors: int, link_mbps: float, cap_mbps: float, chunk_bytes: int,
                   kill_at: float | None, run_id: str, stage: int, lab=None) -> dict:
    from protocol import version
    from protocol.transport import RpcClient, RpcServer
    from roles.worker.state.donor_client import DonorSource, choose, fetch_manifests
    from roles.worker.state.run_checkpoint_io import apply_state
    from roles.worker.state.state_donor import StateDonor, TokenBucket
    from roles.worker.state.state_download import MultiDonorDownload
    from roles.worker.state.state_snapshot import thaw

    joiner = await _p2p_in(lab, "joiner")
    hosts = []
    # in the lab the kernel shapes the link; the donor keeps only the product's cap (none: 100x the link)
    upload_mbps = (cap_mbps if cap_mbps < link_mbps else 100 * link_mbps) if lab else min(link_mbps, cap_mbps)
    try:
        for i in range(donors):
            p2p = await _p2p_in(lab, f"donor{i}")
            donor = StateDonor(opt, layout, run_id=run_id, stage=stage, serving=lambda: True, chunk_bytes=chunk_bytes,
                               upload_mbps=upload_mbps, max_concurrent_chunks=4, snapshot_ttl_s=600)
            donor.bucket.tokens = 0.0  # an emulated link has no credit saved up before the test
            server = RpcServer(p2p)
            await server.add_handler(version.STATE_MANIFEST, donor.manifest)
            await server.add_handler(version.STATE_CHUNK, donor.chunk)
            hosts.append((p2p, donor, server, [str(m) for m in await p2p.get_visible_maddrs()]))
        client = RpcClient(joiner, timeout_s=30)
        downlink = TokenBucket(link_mbps * 1e6 / 8, burst_bytes=chunk_bytes)
        downlink.tokens = 0.0
        _, target, _ = fresh()
        started = time.monotonic()
        downlink.updated = started
        for _, donor, _, _ in hosts:
            donor.bucket.updated = started
        candidates = [(p2p.peer_id.to_base58(), maddrs) for p2p, _, _, maddrs in hosts]
        offers, refused = await fetch_manifests(joiner, client, candidates, run_id=run_id, stage=stage,
                                                layout=layout.digest, timeout_s=60)
        manifest, peers = choose(offers)
        frozen_s = time.monotonic() - started
        sources = [DonorSource(client, peer, stage, manifest.manifest_id, 30) for peer in peers]
        if lab is None:
            sources = [Downlink(source, downlink) for source in sources]
        download = MultiDonorDownload(manifest, sources, chunk_timeout_s=30, total_timeout_s=600,
                                      inflight_per_source=2, show_progress=False)
        killed = {}
        if kill_at is not None:
            victim = hosts[0][0]

            def on_chunk(index, name):
                if not killed and download.remaining <= (1 - kill_at) * manifest.num_chunks:
                    killed["at_s"] = round(time.monotonic() - started, 3)
                    killed["chunks_done"] = manifest.num_chunks - download.remaining
                    asyncio.get_running_loop().create_task(victim.shutdown())

            download.on_chunk = on_chunk
        blob, result = await download.run()
        fetched_s = time.monotonic() - started
        _, state = await asyncio.to_thread(thaw, blob, layout.names)
        await asyncio.to_thread(apply_state, state, target, layout, with_optimizer=True)
        join_s = time.monotonic() - started
        exact = all(bool((a == b).all()) for a, b in zip(target.master_params, opt.master_params))
        await client.close()
        served = [dict(d.counters) for _, d, _, _ in hosts]
        rate = min(link_mbps, donors * min(link_mbps, cap_mbps))
        ideal = manifest.total_bytes * 8 / (rate * 1e6)
        return {"donors": donors, "link_mbps": link_mbps, "donor_cap_mbps": cap_mbps, "kill_at": kill_at,
                "bytes": manifest.total_bytes, "chunks": manifest.num_chunks, "chunk_bytes": chunk_bytes,
                "join_s": round(join_s, 3), "manifests_s": round(frozen_s, 3), "download_s": round(fetched_s, 3),
                "transfer_s": round(fetched_s - frozen_s, 3),
                "ideal_transfer_s": round(ideal, 3), "exact": exact, "killed": killed or None,
                "requeued": result.requeued, "stolen": result.stolen, "endgame": result.endgame,
                "per_donor": [{"chunks": o.chunks, "failures": dict(o.failures), "wasted": o.wasted,
                               "dropped": o.dropped} for o in result.donors.values()],
                "donor_throttled_ms": [s.get("donor_throttled_ms", 0) for s in served]}
    finally:
        for p2p, donor, server, _ in hosts:
            donor.close()
            await server.shutdown()
            await p2p.shutdown()
        await joiner.shutdown()


def _lab(args, donors: int):
    """The joiner and `donors` donors, each on its own residential-style link."""
    from node.netlab.plan import HostSpec
    from node.netlab.topology import Lab

    _run_daemons_in_namespaces()
    link = dict(up_mbit=args.link_mbps, down_mbit=args.link_mbps, rtt_ms=args.rtt_ms)
    return Lab([HostSpec("joiner", **link), *(HostSpec(f"donor{i}", **link) for i in range(donors))],
               subnet="10.83.0.0/16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="surrogate-1b")
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--link-mbps", type=float, default=100.0)
    parser.add_argument("--donor-cap-mbps", type=float, default=50.0)
    parser.add_argument("--chunk-mib", type=float, default=1.0,
                        help="chunk size (the run config's default is 4 MiB; a 29 MB state wants finer chunks to "
                        "spread over 4 donors)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--capped-only", action="store_true",
                        help="only the series with donors capped at --donor-cap-mbps (not the uncapped one)")
    parser.add_argument("--quick", action="store_true", help="one repeat of 1 and 2 donors and one death")
    parser.add_argument("--lab", action="store_true",
                        help="real links: each p2pd in a network-lab namespace, shaped in the kernel (needs root)")
    parser.add_argument("--rtt-ms", type=float, default=20.0,
                        help="with --lab: each host's access-link RTT (a donor-joiner path has twice this)")
    args = parser.parse_args()

    info = machine_info()
    run, opt, layout, fresh = build_state(args.preset, args.stage)
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    cases = []
    caps = [args.donor_cap_mbps] if args.capped_only else [args.donor_cap_mbps, args.link_mbps]
    for cap in caps:
        for donors in ((1, 2) if args.quick else (1, 2, 4)):
            cases.append(dict(donors=donors, cap_mbps=cap, kill_at=None))
        for donors in ((2,) if args.quick else (2, 4)):
            cases.append(dict(donors=donors, cap_mbps=cap, kill_at=0.25))
        if args.quick:
            break
    results = []
    with contextlib.ExitStack() as stack:
        lab = stack.enter_context(_lab(args, max(c["donors"] for c in cases))) if args.lab else None
        for case in cases:
            for _ in range(1 if args.quick else args.repeats):
                log(f"scenario {case} ...")
                out = asyncio.run(scenario(opt, layout, fresh, link_mbps=args.link_mbps, chunk_bytes=chunk_bytes,
                                           run_id=run.run_id, stage=args.stage, lab=lab, **case))
                log(f"  join {out['join_s']}s (ideal transfer {out['ideal_transfer_s']}s), exact={out['exact']}")
                log("  " + json.dumps(out))  # a run cut short still leaves its finished scenarios
                results.append(out)
    table = []
    for case in cases:
        runs = [r for r in results if r["donors"] == case["donors"] and r["donor_cap_mbps"] == case["cap_mbps"]
                and r["kill_at"] == case["kill_at"]]
        table.append({"donors": case["donors"], "donor_cap_mbps": case["cap_mbps"], "kill_at": case["kill_at"],
                      "runs": len(runs), "ideal_transfer_s": runs[0]["ideal_transfer_s"],
                      **{f"median_{k}": round(statistics.median(r[k] for r in runs), 3)
                         for k in ("join_s", "manifests_s", "transfer_s")},
                      "all_exact": all(r["exact"] for r in runs)})
    print(json.dumps({"bench": "state_download", "preset": args.preset, "stage": args.stage,
                      "state_bytes": results[0]["bytes"], "layout_values": layout.numel,
                      "links": (f"network lab: one namespace per p2pd, {args.link_mbps:g} Mbit/s up and down shaped "
                                f"in the kernel and the lab's switch, {2 * args.rtt_ms:g} ms RTT donor-joiner"
                                if args.lab else
                                "emulated: donor upload token bucket at min(link, cap) + one joiner downlink bucket"),
                      "machine": info, "summary": table, "results": results}, indent=1))


if __name__ == "__main__":
    main()
