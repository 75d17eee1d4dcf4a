"""AsyncSPARTA round benchmark: how long one averaging round of a stage takes, and how close it
comes to bare hivemind averaging and to a raw libp2p stream. Prints ONE JSON object on stdout
(logs go to stderr); `--out PATH` also writes it to a file; `--quick` runs only the smallest
stage.

What is measured, and why that way:

`ours`
    One round exactly as a worker runs it (roles/worker/averaging: SegmentRound over a
    StageAverager): gather segment `round mod 20` of the stage's flat parameters (p = 5%) into the
    fixed-size round buffer under the optimizer lock, set the round's group key and size, run
    hivemind's butterfly all-reduce through the instrumented runner, read the result back and
    apply it with the delta rule. `round_s` is the wall time from the first replica entering the
    round to the last one leaving it (a round is over when every replica has applied it), the
    median over `--rounds` measured rounds after one warm-up round (alternating with the bare
    hivemind rounds below, so that a change in the machine's load hits both alike). `allreduce_s`
    is the part
    the averager process spent inside the all-reduce, as its runner measured it. All replicas
    are reducers; each has its own DHT node, libp2p daemon and averager process, forked from this
    process, on 127.0.0.1. The index set of the round is computed before the timer starts (the
    worker prepares the next round's set in the background while it trains); its cost is
    reported per size as `index_set_s`.

`hivemind`
    The same bytes through bare hivemind averaging: a plain `DecentralizedAverager` over a
    buffer of the same size, with the same matchmaking window, group size target, chunk size and
    timeouts, replicas stepping at the same moment. `ratio_vs_hivemind` = hivemind round time /
    our round time (1.0 = no overhead; the aim is >= 0.9). `ratio_step_vs_hivemind` compares
    bare hivemind's round with our slowest replica's matchmaking + all-reduce alone, i.e. without
    the gather into the buffer and the delta applied back to the parameters: what is left of the
    difference is that host-side work, which here all replicas do on the same 2 cores.

`stream`
    The ceiling of the transport: the buffer's bytes pushed through ONE long-lived libp2p binary
    stream between two daemons on this machine, in 1 MiB length-prefixed frames (our framing),
    one direction. `ratio_vs_stream` = our bytes/s / stream bytes/s, where our bytes/s is the
    round buffer's bytes (what each replica contributes) over the round time. A butterfly round
    moves about 2 (R-1)/R times those bytes per replica, in and out, so this ratio is well below
    1 by construction; it says how far the whole round is from the wire.

Sizes are stages of 10M, 50M and 100M float32 parameters with 2, 4 and 8 replicas. A combination
is skipped (and listed with the reason) if its replicas' parameters would not fit in the memory
available, or if the time budget (`--budget-s`) would be exceeded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

mp.set_start_method("fork", force=True)  # hivemind needs fork

import psutil  # noqa: E402
import torch  # noqa: E402

from _bench_common import log, machine_info  # noqa: E402

SEGMENTS = 20
MATCHMAKING_S = 3.0


class Store:
    """A replica's parameters as the round sees them (what StageOptimizer provides)."""

    def __init__(self, tensors):
        self.lock = threading.RLock()
        self.master_params = tensors

    def push_master_to_device(self):
        pass


def _config():
    from protocol.run_config import AveragingConfig

    return AveragingConfig(matchmaking_time_s=MATCHMAKING_S, request_timeout_s=1.0, sender_timeout_s=60.0,
                           allreduce_timeout_s=600.0)


async def _stream_rate(nbytes: int) -> float:
    """Bytes/s of one framed libp2p binary stream between two local daemons."""
    from hivemind.p2p import P2P

    from protocol.framing import read_frame, write_frame

    server = await P2P.create()
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    try:
        async def sink(info, reader, writer):
            received = 0
            while received < nbytes:
                received += len(await read_frame(reader, 1 << 22))
            await write_frame(writer, b"ok")

        await server.add_binary_stream_handler("bench/stream", sink)
        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "bench/stream")
        chunk = os.urandom(1 << 20)
        await write_frame(writer, chunk[:1024])  # open the stream before timing
        started, sent = time.perf_counter(), 1024
        while sent < nbytes:
            piece = chunk[: min(len(chunk), nbytes - sent)]
            await write_frame(writer, piece)
            sent += len(piece)
        await asyncio.wait_for(read_frame(reader), 120)
        return nbytes / (time.perf_counter() - started)
    finally:
        await client.shutdown()
        await server.shutdown()


def _run_together(fns) -> list:
    """Run the callables in parallel threads, return their results (or exceptions)."""
    results = [None] * len(fns)

    def go(i):
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - reported in the JSON
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(fns))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    return results


class OurRounds:
    """Replicas running rounds exactly as workers do (SegmentRound over StageAverager)."""

    def __init__(self, dhts, stores, index_sets, replicas: int, tag: str):
        from roles.worker.averaging.averager import StageAverager
        from roles.worker.averaging.rounds import SegmentRound

        self.index_sets, self.replicas = index_sets, replicas
        self.averagers = []
        for dht in dhts[:replicas]:
            averager = StageAverager(dht, index_sets.buffer_size, run_id=tag, stage=0, reducer=True, config=_config())
            averager.start()
            self.averagers.append(averager)
        self.runners = [SegmentRound(store, index_sets, averager) for store, averager in zip(stores, self.averagers)]
        self.times, self.allreduce, self.statuses, self.parts = [], [], [], {}

    def round(self, round_id: int, measure: bool) -> None:
        from roles.worker.averaging.rounds import RoundPlan

        segment = round_id % SEGMENTS
        self.index_sets.get(segment)  # a worker prepares it in the background while it trains
        plan = RoundPlan("bench", round_id, segment, 1.0, self.replicas, "active")
        started = time.perf_counter()
        outcomes = _run_together([lambda r=r: r.run(plan) for r in self.runners])
        elapsed = time.perf_counter() - started
        bad = [o for o in outcomes if isinstance(o, BaseException)]
        if bad:
            raise bad[0]
        if not measure:
            return
        self.times.append(elapsed)
        self.allreduce.append(max(o.allreduce_s or 0.0 for o in outcomes))
        self.statuses.extend(o.status.value for o in outcomes)
        for name in outcomes[0].timings:
            self.parts.setdefault(name, []).append(max(o.timings.get(name, 0.0) for o in outcomes))

    def report(self) -> dict:
        return {"round_s": statistics.median(self.times), "round_s_all": [round(t, 3) for t in self.times],
                "allreduce_s": statistics.median(self.allreduce),
                "slowest_replica_s": {name: round(statistics.median(v), 4) for name, v in self.parts.items()},
                "statuses": {s: self.statuses.count(s) for s in sorted(set(self.statuses))}}

    def close(self) -> None:
        for averager in self.averagers:
            averager.shutdown()


class BareRounds:
    """The same bytes through plain hivemind DecentralizedAverager steps."""

    def __init__(self, dhts, buffer_size: int, replicas: int, tag: str):
        from hivemind.averaging import DecentralizedAverager

        config = _config()
        self.timeout = 2 * config.matchmaking_time_s
        self.averagers = []
        for dht in dhts[:replicas]:
            averager = DecentralizedAverager(
                [torch.randn(buffer_size)], dht, start=False, prefix=tag, target_group_size=replicas,
                min_group_size=2, min_matchmaking_time=config.matchmaking_time_s,
                request_timeout=config.request_timeout_s, next_chunk_timeout=config.sender_timeout_s,
                sender_timeout=config.sender_timeout_s, reducer_timeout=2 * config.sender_timeout_s,
                allreduce_timeout=config.allreduce_timeout_s, part_size_bytes=config.part_size_bytes,
                allow_state_sharing=False, client_mode=False,
            )
            averager.start()  # not run_in_background: it would make this process ignore Ctrl-C
            averager.wait_until_ready(60)
            self.averagers.append(averager)
        self.times = []

    def round(self, round_id: int, measure: bool) -> None:
        started = time.perf_counter()
        results = _run_together([lambda a=a: a.step(weight=1.0, timeout=self.timeout, allow_retries=False)
                                 for a in self.averagers])
        elapsed = time.perf_counter() - started
        bad = [r for r in results if isinstance(r, BaseException) or r is None]
        if bad:
            raise RuntimeError(f"bare hivemind round failed: {bad[0]!r}")
        if measure:
            self.times.append(elapsed)

    def report(self) -> dict:
        return {"round_s": statistics.median(self.times), "round_s_all": [round(t, 3) for t in self.times]}

    def close(self) -> None:
        for averager in self.averagers:
            averager.shutdown()


def _compare(dhts, stores, index_sets, replicas: int, rounds: int, tag: str) -> tuple[dict, dict]:
    """One warm-up round each, then measured rounds alternating ours and bare hivemind, so a
    change in the machine's load hits both alike."""
    ours = bare = None
    try:
        ours = OurRounds(dhts, stores, index_sets, replicas, tag + "ours")
        bare = BareRounds(dhts, index_sets.buffer_size, replicas, tag + "bare")
        for round_id in range(rounds + 1):
            ours.round(round_id, measure=round_id > 0)
            bare.round(round_id, measure=round_id > 0)
        return ours.report(), bare.report()
    finally:
        for side in (ours, bare):
            if side is not None:
                side.close()


# ---- SparseLoCo ---------------------------------------------------------------------------------

SPARSELOCO_H = 15


async def _sparseloco_exchange(fragments: list[bytes], key, rounds: int, transport: str, tmp: str) -> dict:
    """Median wall time of a round in which R replicas (one P2P daemon each, in this process)
    exchange their fragments: `swarm` pushes over our RPC streams (SwarmTransport), `store`
    goes through a directory (StoreTransport), as the workers do."""
    from hivemind.p2p import P2P

    from protocol import version
    from protocol.messages import SparseLoCoFragmentReply, SparseLoCoFragmentRequest, parse_model
    from protocol.transport import RpcClient, RpcServer, frame_bytes
    from roles.worker.sparseloco.transport import FragmentInbox, RoundKey, StoreTransport, SwarmTransport

    replicas = len(fragments)
    limit = lambda f: 2 * max(map(len, fragments)) + 4096  # noqa: E731
    times, sent = [], []
    if transport == "store":
        ids = [f"replica{r}" for r in range(replicas)]
        sides = [StoreTransport(tmp, "bench", 0, ids[r], lambda: ids, limit) for r in range(replicas)]
        for n in range(rounds):
            k = RoundKey(key + n, 0)
            t0 = time.perf_counter()
            done = await asyncio.gather(*(sides[r].exchange(k, fragments[r], time.monotonic() + 120)
                                          for r in range(replicas)))
            times.append(time.perf_counter() - t0)
            assert all(len(d.received) == replicas - 1 for d in done), [len(d.received) for d in done]
            sent.append(done[0].bytes_sent + done[0].bytes_received)
        return {"round_s": round(statistics.median(times), 4), "bytes_per_round": sent[0]}
    first = await P2P.create()
    p2ps = [first] + [await P2P.create(initial_peers=await first.get_visible_maddrs()) for _ in range(replicas - 1)]
    ids = [p.peer_id.to_base58() for p in p2ps]
    servers, clients, sides = [], [], []
    try:
        for r, p2p in enumerate(p2ps):
            inbox = FragmentInbox(limit)
            server = RpcServer(p2p, max_frame_bytes=1 << 28)

            async def serve(peer_id, body, inbox=inbox):
                req = parse_model(SparseLoCoFragmentRequest, body)
                inbox.put(peer_id.to_base58(), RoundKey(req.round, req.fragment), req.data, SPARSELOCO_H)
                return SparseLoCoFragmentReply()

            await server.add_handler(version.SPARSELOCO_FRAGMENT, serve)
            client = RpcClient(p2p, timeout_s=120, max_frame_bytes=1 << 28)

            async def push(peer, k, data, deadline, client=client):
                from hivemind.p2p import PeerID

                req = SparseLoCoFragmentRequest(stage=0, round=k.round, fragment=k.fragment, data=data)
                await client.request(PeerID.from_base58(peer), version.SPARSELOCO_FRAGMENT, req,
                                     SparseLoCoFragmentReply, timeout_s=max(0.1, deadline - time.monotonic()))
                return frame_bytes(req)

            servers.append(server)
            clients.append(client)
            sides.append(SwarmTransport(ids[r], inbox, push, lambda: ids))
        for n in range(rounds + 1):  # the first round opens the streams
            k = RoundKey(key + n, 0)
            t0 = time.perf_counter()
            done = await asyncio.gather(*(sides[r].exchange(k, fragments[r], time.monotonic() + 120)
                                          for r in range(replicas)))
            if n:
                times.append(time.perf_counter() - t0)
            assert all(len(d.received) == replicas - 1 for d in done), [len(d.received) for d in done]
            sent.append(done[0].bytes_sent)
        return {"round_s": round(statistics.median(times), 4), "bytes_per_round": sent[-1]}
    finally:
        for client in clients:
            await client.close()
        for server in servers:
            await server.shutdown()
        for p in p2ps:
            await p.shutdown()


def _sparseloco_section(sizes: list[int], replica_counts: list[int], rounds: int) -> dict:
    """Per stage size: the compressor's cost on the compute thread, the fragment's bytes against
    the arithmetic and the dense pseudo-gradient, and per replica count the exchange's wall time
    over the swarm and through a store, with the bytes per replica per step against AsyncSPARTA's."""
    import tempfile

    from protocol.identity import load_or_create_identity
    from protocol.run_config import SparseLoCoConfig
    from roles.worker.layout import FlatLayout
    from roles.worker.sparseloco.chunks import plan_fragments
    from roles.worker.sparseloco.codec import Envelope, decode_fragment, encode_fragment, expected_payload_bytes
    from roles.worker.sparseloco.outer import SparseLoCoState

    config = SparseLoCoConfig()
    out: dict = {"settings": {**config.model_dump(mode="json"), "inner_steps": SPARSELOCO_H,
                              "asyncsparta": {"segments": SEGMENTS, "average_every": 20}}, "results": []}
    tmp = tempfile.mkdtemp(prefix="bench-sparseloco-")
    ids = [load_or_create_identity(os.path.join(tmp, f"id{r}.key")) for r in range(max(replica_counts))]
    for size in sizes:
        layout = FlatLayout(["w", "b"], [(size - 1000, ), (1000,)])
        [frag] = plan_fragments(layout, chunk_size=config.chunk_size, topk=config.topk_per_chunk, fragments=1)
        anchor = torch.randn(size)
        fragments, capture_s = [], []
        for r in range(max(replica_counts)):
            state = SparseLoCoState.starting_at(anchor)
            weights = anchor - 0.01 * torch.randn(size)
            t0 = time.perf_counter()
            cap = state.capture(SPARSELOCO_H, frag, weights, beta=config.error_decay, bits=config.bits)
            env = Envelope("bench", 0, SPARSELOCO_H, 0, layout.digest, config.chunk_size, config.topk_per_chunk,
                           config.bits, sender=ids[r].peer_id.to_base58(), anchor=cap.anchor)
            fragments.append(encode_fragment(cap.own, env, ids[r]))
            capture_s.append(time.perf_counter() - t0)
        probe = Envelope("bench", 0, SPARSELOCO_H, 0, layout.digest, config.chunk_size, config.topk_per_chunk,
                         config.bits)
        t0 = time.perf_counter()
        decoded = [decode_fragment(data, probe, frag)[1] for data in fragments[:2]]
        state = SparseLoCoState.starting_at(anchor)
        state.capture(SPARSELOCO_H, frag, anchor - 0.01, beta=config.error_decay, bits=config.bits)
        state.apply(0, {"a": decoded[0], "b": decoded[1]}, anchor, alpha=config.outer_lr)
        apply_two_s = time.perf_counter() - t0
        arithmetic = expected_payload_bytes(frag, config.bits)
        entry: dict = {"params": size, "fragment_bytes": len(fragments[0]), "arithmetic_bytes": arithmetic,
                       "over_arithmetic": round(len(fragments[0]) / arithmetic - 1, 5),
                       "dense_bytes": 4 * size, "compression": round(4 * size / len(fragments[0]), 1),
                       "capture_s": round(statistics.median(capture_s), 4), "apply_two_s": round(apply_two_s, 4),
                       "replicas": []}
        for replicas in replica_counts:
            row: dict = {"replicas": replicas}
            for transport in ("swarm", "store"):
                try:
                    row[transport] = asyncio.run(_sparseloco_exchange(fragments[:replicas], 1000 * replicas, rounds,
                                                                      transport, os.path.join(tmp, "store")))
                except Exception as exc:  # noqa: BLE001 - one broken combination must not lose the rest
                    row[transport] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            sparta = 2 * (replicas - 1) / replicas * 4 * math.ceil(size / SEGMENTS) / 20
            row["bytes_per_replica_per_step"] = {
                "sparseloco_swarm": round((replicas - 1) * len(fragments[0]) / SPARSELOCO_H),
                "sparseloco_store": round(replicas * len(fragments[0]) / SPARSELOCO_H),
                "asyncsparta": round(sparta),
                "gradients_every_step": (replicas - 1) * 4 * size}
            row["asyncsparta_over_sparseloco"] = round(sparta / row["bytes_per_replica_per_step"]["sparseloco_swarm"], 2)
            entry["replicas"].append(row)
            log(f"sparseloco {size / 1e6:.0f}M x {replicas}: {json.dumps(row)}")
        out["results"].append(entry)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10e6,50e6,100e6", help="stage sizes in parameters")
    parser.add_argument("--replicas", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds per combination (after a warm-up)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="skip combinations that would exceed this")
    parser.add_argument("--quick", action="store_true", help="only the smallest stage, 2 and 4 replicas, 1 round")
    parser.add_argument("--method", choices=("asyncsparta", "sparseloco", "both"), default="both",
                        help="which method's section to run (default both)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    replica_counts = [int(r) for r in args.replicas.split(",")]
    if args.quick:
        sizes, replica_counts, args.rounds = sizes[:1], [r for r in replica_counts if r <= 4], 1
    torch.set_num_threads(1)
    started = time.monotonic()
    if args.method == "sparseloco":
        text = json.dumps({"machine": machine_info(), "sparseloco": _sparseloco_section(sizes, replica_counts,
                                                                                         max(args.rounds, 1))})
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0

    import hivemind

    from roles.worker.averaging.index_sets import SegmentIndexSets
    from roles.worker.layout import FlatLayout

    result: dict = {"machine": machine_info(), "settings": {
        "segments": SEGMENTS, "p": 1 / SEGMENTS, "matchmaking_time_s": MATCHMAKING_S,
        "part_size_bytes": _config().part_size_bytes, "measured_rounds": args.rounds, "reducers": "all replicas",
        "budget_s": args.budget_s}, "results": [], "skipped": [], "index_set_s": {}, "stream": {}}
    log("starting the libp2p stream ceiling")
    for size in sizes:
        nbytes = 4 * math.ceil(size / SEGMENTS)
        rate = asyncio.run(_stream_rate(nbytes))
        result["stream"][str(size)] = {"bytes": nbytes, "bytes_per_s": round(rate), "seconds": round(nbytes / rate, 4)}
    log("starting", max(replica_counts), "DHT nodes")
    dhts = [hivemind.DHT(start=True)]
    while len(dhts) < max(replica_counts):
        dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True))
    seconds_per_byte = None
    try:
        for size in sizes:
            layout = FlatLayout(["w", "b"], [(size - 1000, ), (1000,)])
            index_sets = SegmentIndexSets(layout, SEGMENTS, seed=0, stage=0)
            t0 = time.perf_counter()
            index_sets.get(0)
            result["index_set_s"][str(size)] = round(time.perf_counter() - t0, 3)
            buffer_bytes = 4 * index_sets.buffer_size
            stores: list[Store] = []
            for replicas in replica_counts:
                tag = f"bench{size}x{replicas}"
                need = 4 * size * replicas * 1.3
                available = psutil.virtual_memory().available
                if need > available:
                    result["skipped"].append({"params": size, "replicas": replicas,
                                              "reason": f"needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} free"})
                    continue
                elapsed = time.monotonic() - started
                estimate = 0.0 if seconds_per_byte is None else seconds_per_byte * buffer_bytes * replicas
                if elapsed + estimate > args.budget_s:
                    result["skipped"].append({"params": size, "replicas": replicas,
                                              "reason": f"time budget: {elapsed:.0f}s spent, ~{estimate:.0f}s more"})
                    continue
                while len(stores) < replicas:
                    base = stores[0].master_params if stores else [torch.randn(s) for s in layout.shapes]
                    stores.append(Store([t.clone().add_(len(stores)) for t in base]))
                log(f"{size / 1e6:.0f}M parameters x {replicas} replicas")
                combo_started = time.monotonic()
                entry = {"params": size, "replicas": replicas, "segment_values": index_sets.buffer_size,
                         "bytes": buffer_bytes}
                try:
                    entry["ours"], entry["hivemind"] = _compare(dhts, stores, index_sets, replicas, args.rounds, tag)
                except Exception as exc:  # noqa: BLE001 - one broken combination must not lose the rest
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    result["results"].append(entry)
                    continue
                ours, bare = entry["ours"], entry["hivemind"]
                ours["bytes_per_s"] = round(buffer_bytes / ours["round_s"])
                bare["bytes_per_s"] = round(buffer_bytes / bare["round_s"])
                entry["ratio_vs_hivemind"] = round(bare["round_s"] / ours["round_s"], 3)
                entry["ratio_step_vs_hivemind"] = round(bare["round_s"] / ours["slowest_replica_s"]["step_s"], 3)
                entry["ratio_vs_stream"] = round(ours["bytes_per_s"] / result["stream"][str(size)]["bytes_per_s"], 4)
                result["results"].append(entry)
                seconds_per_byte = (time.monotonic() - combo_started) / (buffer_bytes * replicas)
                log(json.dumps(entry))
            del stores
    finally:
        for dht in dhts:
            dht.shutdown()
    if args.method == "both":
        result["sparseloco"] = _sparseloco_section(sizes, replica_counts, max(args.rounds, 1))
    ratios = [e["ratio_vs_hivemind"] for e in result["results"] if "ratio_vs_hivemind" in e]
    result["summary"] = {
        "combinations_measured": len(ratios),
        "ratio_vs_hivemind_min": min(ratios, default=None),
        "ratio_vs_hivemind_median": statistics.median(ratios) if ratios else None,
        "total_s": round(time.monotonic() - started, 1),
    }
    text = json.dumps(result)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
