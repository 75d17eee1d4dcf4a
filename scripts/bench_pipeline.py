"""Pipeline benchmark: how much of one machine's training throughput a local agora swarm keeps,
where its time goes, and what a node costs in memory. Prints ONE JSON object on stdout (logs go
to stderr); `--out PATH` also writes it to a file, `--quick` shortens every window (CI smoke).

What each number means, and why it is measured that way:

`swarm_vs_centralized`
    Swarm tokens/s divided by the tokens/s of the same model trained in ONE process with the
    same global batch (`target_batch_size` samples of `seq_len` tokens per optimizer step) on
    the same cores. The swarm is the `tiny` preset, or `--preset cpu-compute` (3 stages, one
    worker each, `torch_threads=1` per node), driven by two trainers; its rate is taken over a steady window only: start-up,
    discovery and the first samples are discarded (warm-up of N samples seen at the head
    worker), then tokens are read from the trainers' own signed DHT records at the start and
    end of the window and divided by the difference of the records' timestamps, so neither
    process start-up nor announcement lag enters the rate. The head worker's backward counter
    (a sample is complete once the head has run its backward) gives a cross-check. The
    centralized reference builds the three StageModels in this process, chains them with
    FullModel (no boundary compression, no activation recomputation: the work a single process
    would really do), uses AdamW with the run's hyperparameters and per-stage clipping,
    `torch.set_num_threads(2)`, and draws its batches from the same synthetic stream inside the
    timed loop (capped in time: under contention it would otherwise take minutes). The ratio
    therefore prices everything the swarm adds: recomputation in backward, boundary compression,
    serialization, libp2p hops, DHT traffic and 5+ Python processes sharing 2 cores. A 2-thread
    reference collapses when another job takes a core (its OpenMP threads wait for each other at
    every op), which would flatter the swarm, so `ratio_vs_fastest_centralized` divides by the
    best single-process rate seen (its fastest 10-step block, or a 1-thread run) as well.

`utilization_by_lanes`
    For 1, 2, 4 and 8 lanes (ONE trainer holding all lanes), each worker's compute time over wall
    time in a fixed window: `compute_ms` from the worker's own `agora/v1/info` counters at the
    start and end of the window (the compute thread adds the duration of every batch it runs),
    over the wall time between the two calls. It answers "does one trainer keep the pipeline
    busy, and how many lanes does it take?". Batch sizes (requests per coalesced batch) and the
    CPU each process used in the window are reported beside it, because on a 2-core machine the
    usual limit is not the pipeline but the cores every process shares. `idle_swarm_cpu_cores`
    is the CPU the three workers burn with no trainer at all (DHT announcements and stage
    progress ticks): the fixed cost the training traffic comes on top of.

`rpc_overhead_ratio`
    The forward round trip of our stack (RpcClient.call -> msgpack envelope -> framed libp2p
    stream -> RpcServer -> `parse_model(ForwardRequest)` -> the worker's own request checks ->
    encoded coords reply -> reply parsing) divided by a bare hivemind binary-stream round trip
    that echoes length-prefixed frames of exactly the same byte sizes on one long-lived stream.
    Both run in this process over two `hivemind.p2p.P2P` instances on 127.0.0.1, in alternating
    blocks (so drift in machine load hits both), with medians over >= 500 round trips each.
    Model compute and the worker's queue/thread hand-off are EXCLUDED: the handler validates,
    then returns a coords tensor of the request's shape. The ratio is the cost of our protocol
    layer on top of the transport, which is what we control.

`peak_rss_mb`
    Peak resident memory (VmHWM from /proc/PID/status) of a worker and of a trainer running 8
    lanes, sampled right before they are stopped. Reported for the node process alone and
    summed over the node and its children (hivemind's forked DHT process, the p2pd daemon and
    torch_shm_manager when torch started one).
    The sum double-counts pages the forked DHT child shares with its parent, so the tree's
    proportional set size (PSS, shared pages split between sharers) is reported too; the aim is
    checked against the conservative VmHWM sum.

`metrics_cost`
    What Prometheus metrics cost the swarm, in the same run: every node has `--metrics-port 0`;
    two trainers train without pause while windows alternate (ABBA order) between this process
    scraping every node's /metrics every second and nobody scraping; `cost` = 1 - mean tokens/s
    scraped / mean tokens/s not scraped (aim: <= 0.01). Scraping every second from the same two
    cores is pessimistic (Prometheus scrapes every 15-60 s from elsewhere). An unscraped port is
    an idle socket; the balance signals the compute thread records per batch are paid in both,
    so that cost is measured apart (`recording_us_per_request`, and its share of the compute per
    request at the cheapest stage). `--only metrics` runs just this part.

Other work on the machine (a 2-core box shared with someone's test run) distorts every number,
so each measurement reports `foreign` cores (machine busy time from /proc/stat minus our own
process trees) and `aims.measured_on_a_busy_machine` flags runs where that exceeded 0.25 cores.

Every process the benchmark starts is stopped (LocalSwarm.stop_all, then a check that no pid of
any node's process group survives); the seed DHT node is shut down, and the shared-memory
segments hivemind leaves in /dev/shm for this process and the seed DHT process are removed at
exit.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import re
import shutil
import signal
import statistics
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a file: find _bench_common
from _bench_common import (  # noqa: E402
    CpuMeter,
    emit_report,
    cpu_by_part,
    dialable_maddrs,
    log,
    machine_info,
    memory_of,
    own_cpu_seconds,
    percentile,
    process_tree,
    remove_own_shared_memory,
    rounded,
    rss_mb,
    system_busy_s,
)

AIMS = {
    "metrics_cost_max": 0.01,
    "swarm_vs_centralized_min": 0.7,
    "utilization_min_at_enough_lanes": 0.9,
    "rpc_overhead_ratio_max": 1.15,
    "trainer_8_lanes_peak_rss_mb_max": 400.0,
}
LANES = (1, 2, 4, 8)
WORKER_MAX_BATCH = 16


@dataclass(frozen=True)
class Windows:
    """How long each measurement runs; `--quick` shortens all of them."""

    swarm_window_s: float
    lanes_window_s: float
    warmup_samples: int
    warmup_s: float
    rpc_round_trips: int
    rpc_block: int
    central_steps: int
    central_warmup_steps: int
    central_budget_s: float
    idle_window_s: float
    deadline_s: float  # the lane windows shrink (to 3 s at least) to end the measurements by then
    swarm_lanes_per_trainer: int = 4
    metrics_window_s: float = 10.0
    metrics_pairs: int = 3
    routing: tuple[str, ...] = ("trainer", "workers")
    """Routing paths (a) measures side by side; the lane sweep (b) and the rest use the trainer's."""
    only_swarm: bool = False
    """`--only swarm`: the centralized reference and (a), nothing else (a frontier point)."""


FULL = Windows(swarm_window_s=20.0, lanes_window_s=15.0, warmup_samples=48, warmup_s=4.0,
               rpc_round_trips=1500, rpc_block=50, central_steps=100, central_warmup_steps=10,
               central_budget_s=20.0, idle_window_s=5.0, deadline_s=280.0)
QUICK = Windows(swarm_window_s=5.0, lanes_window_s=4.0, warmup_samples=16, warmup_s=1.5,
                rpc_round_trips=500, rpc_block=50, central_steps=20, central_warmup_steps=5,
                central_budget_s=6.0, idle_window_s=2.0, deadline_s=150.0, metrics_window_s=6.0, metrics_pairs=2)


# ---------------------------------------------------------------------------------------------
# run config
# ---------------------------------------------------------------------------------------------

def bench_run_config(preset: str = "tiny", overrides: Optional[dict] = None):
    """`preset` (tiny: 3 stages of one block; cpu-compute: 3 compute-bound stages of two blocks),
    under a run id of its own, with `overrides` (--gate, --target-batch-size) merged in."""
    from protocol.run_config import load_run_config

    return load_run_config(preset, {"run_id": f"bench-{os.getpid()}", **(overrides or {})})


# ---------------------------------------------------------------------------------------------
# (c) RPC overhead: our forward round trip vs a bare hivemind binary stream, same bytes
# ---------------------------------------------------------------------------------------------

def _validating_runtime(run, stage: int):
    """A StageRuntime for `stage` whose compute thread is never started: only its request checks
    (`check_forward`, exactly what a worker runs before queueing) are used."""
    from roles.model.stage import StageModel
    from roles.worker.steps.optimizer import StageOptimizer
    from roles.worker.serving.queues import TaskQueues
    from roles.worker.serving.runtime import StageRuntime

    model = StageModel(run, stage)
    opt = run.optimizer
    optimizer = StageOptimizer(model.trainable_parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                               weight_decay=opt.weight_decay, warmup_steps=opt.warmup_steps,
                               total_steps=opt.total_steps, min_lr_ratio=opt.min_lr_ratio,
                               clip_threshold=run.clip_threshold(stage), device="cpu")
    return StageRuntime(model, optimizer, TaskQueues(WORKER_MAX_BATCH), stage=stage,
                        vocab_size=run.model.vocab_size, max_seq_len=run.model.max_seq_len,
                        device=model.basis.device)


async def measure_rpc_overhead(run, round_trips: int, block: int) -> dict:
    import torch
    from hivemind.p2p import P2P

    from protocol import hivemind_adapter, version
    from protocol.codec import encode_tensor, pack, unpack
    from protocol.framing import read_frame, write_frame
    from protocol.messages import ForwardRequest, parse_model
    from protocol.transport import RpcClient, RpcServer, hello_frame
    from roles.trainer.data import make_sample_stream

    stage = 1  # a body stage: tokens and coords both travel
    runtime = _validating_runtime(run, stage)
    seq_len, rank = run.seq_len, run.model.subspace_rank
    sample = next(iter(make_sample_stream("synthetic", None, seq_len, 0, 1, run.seed, epochs=None)))
    coords = torch.randn(seq_len, rank, dtype=torch.float32)
    output = torch.randn(seq_len, rank, dtype=torch.float32)  # stands in for the stage's output
    body = {"stage": stage, "sample_id": "bench-s0-0", "tokens": encode_tensor(sample.tokens),
            "coords": encode_tensor(coords)}
    handler_s: list[float] = []

    async def forward_without_compute(peer_id, request_body: dict) -> dict:
        started = time.perf_counter()
        request = parse_model(ForwardRequest, request_body)
        runtime.check_forward(request)  # the worker's checks: stage, dtype, shape, id range, finiteness
        reply = {"coords": encode_tensor(output)}
        handler_s.append(time.perf_counter() - started)
        return reply

    header = struct.Struct(">I")
    sizes: dict[str, int] = {}

    async def echo(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reply = header.pack(sizes["reply"]) + os.urandom(sizes["reply"])
        try:
            while True:
                (n,) = header.unpack(await reader.readexactly(header.size))
                await reader.readexactly(n)
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    rpc = RpcClient(client, timeout_s=10.0)
    writer = None
    try:
        await hivemind_adapter.connect(client, server.peer_id, dialable_maddrs(await server.get_visible_maddrs()))
        rpc_server = RpcServer(server)
        await rpc_server.add_handler(version.FORWARD, forward_without_compute)
        await server.add_binary_stream_handler("bench/echo", echo)

        # Frame sizes as they are on the wire: one request as an open-run RpcClient frames it,
        # sent on a raw stream to the real RpcServer, and the reply frame it sends back.
        _, raw_reader, raw_writer = await client.call_binary_stream_handler(server.peer_id, version.FORWARD)
        await write_frame(raw_writer, hello_frame(version.FORWARD, server.peer_id.to_base58())[0])
        await read_frame(raw_reader)  # the ack
        request_frame = pack({"seq": 1, "body": body})
        await write_frame(raw_writer, request_frame)
        reply_frame = await read_frame(raw_reader)
        raw_writer.close()
        if unpack(reply_frame).get("ok") is not True:
            raise RuntimeError(f"the forward handler refused the benchmark request: {unpack(reply_frame)!r:.300}")
        sizes.update(request=len(request_frame), reply=len(reply_frame))
        bare_request = header.pack(sizes["request"]) + os.urandom(sizes["request"])
        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "bench/echo")

        async def ours_once() -> float:
            t = time.perf_counter()
            reply = await rpc.call(server.peer_id, version.FORWARD, body)
            elapsed = time.perf_counter() - t
            if "coords" not in reply:
                raise RuntimeError(f"unexpected forward reply {reply!r:.200}")
            return elapsed

        async def bare_once() -> float:
            t = time.perf_counter()
            writer.write(bare_request)
            await writer.drain()
            (n,) = header.unpack(await reader.readexactly(header.size))
            await reader.readexactly(n)
            return time.perf_counter() - t

        for _ in range(max(20, block)):  # warm-up: stream setup, first-call imports, caches
            await ours_once()
            await bare_once()
        handler_s.clear()
        meter = CpuMeter()
        ours: list[float] = []
        bare: list[float] = []
        blocks = math.ceil(round_trips / block)
        for i in range(blocks):
            order = ((ours_once, ours), (bare_once, bare)) if i % 2 == 0 else ((bare_once, bare), (ours_once, ours))
            for fn, sink in order:
                for _ in range(block):
                    sink.append(await fn())
        load = meter.read()
        rejected = dict(rpc_server.rejected)
        await rpc_server.shutdown()
    finally:
        if writer is not None:
            writer.close()
        await rpc.close()
        await client.shutdown()
        await server.shutdown()

    def stats(values: list[float]) -> dict:
        ms = [v * 1000 for v in values]
        return {"round_trips": len(ms), "p50_ms": rounded(percentile(ms, 0.5), 4),
                "p95_ms": rounded(percentile(ms, 0.95), 4), "mean_ms": rounded(statistics.fmean(ms), 4)}

    ratio = statistics.median(ours) / statistics.median(bare)
    return {
        "ratio": rounded(ratio),
        "ours": stats(ours),
        "bare": stats(bare),
        "extra_ms_p50": rounded((statistics.median(ours) - statistics.median(bare)) * 1000, 4),
        "where_the_extra_goes_us": {
            "handler_parse_validate_encode_p50": rounded(statistics.median(handler_s) * 1e6, 1),
            **_envelope_codec_us(body),
            "rest": "event-loop scheduling on both sides (coroutine frames, stream buffers, the client's "
                    "deadline) and GC; not separately measurable",
        },
        "cpu_during_measurement": load,
        "payload_bytes": {"request_frame": sizes["request"] + header.size, "reply_frame": sizes["reply"] + header.size,
                          "tokens": seq_len * 8, "coords": seq_len * rank * 4},
        "server_rejections": rejected,
        "method": (
            "in-process, two hivemind.p2p.P2P instances on 127.0.0.1 connected directly; 'ours' = "
            "RpcClient.call('agora/v1/forward') with a real body-stage ForwardRequest (tokens [seq_len] int64, "
            "coords [seq_len, k] float32) against an RpcServer (open run, no authenticator: what the worker "
            "registers today) whose handler runs parse_model(ForwardRequest) and the worker's "
            "StageRuntime.check_forward, then returns an encoded coords tensor of the same shape; model compute "
            "and the worker's queue/compute-thread hand-off are EXCLUDED. 'bare' = one long-lived "
            "add_binary_stream_handler stream echoing 4-byte length-prefixed frames of exactly the byte sizes our "
            f"request and reply frames have on the wire. Alternating blocks of {block} round trips (order flipped "
            "every block), after a warm-up; ratio = median(ours) / median(bare)."
        ),
    }


def _envelope_codec_us(body: dict, repeats: int = 2000) -> dict:
    """Synchronous cost of framing one request through the protocol's public codec functions
    (client: pack the numbered request frame; server: unpack and validate it)."""
    from protocol.codec import pack
    from protocol.messages import parse_request_frame

    try:
        frame = pack({"seq": 1, "body": body})
        steps = {"client_pack_request": lambda: pack({"seq": 1, "body": body}),
                 "server_unpack_request_envelope": lambda: parse_request_frame(frame).body}
        result = {}
        for name, fn in steps.items():
            fn()
            started = time.perf_counter()
            for _ in range(repeats):
                fn()
            result[name] = round((time.perf_counter() - started) / repeats * 1e6, 1)
        return result
    except Exception as exc:  # noqa: BLE001 - a diagnostic; the protocol may have moved on
        return {"codec_breakdown_error": f"{type(exc).__name__}: {exc}"}


# ---------------------------------------------------------------------------------------------
# (a, reference) centralized training in this process
# ---------------------------------------------------------------------------------------------

def measure_centralized(run, steps: int, warmup_steps: int, threads: int = 2, budget_s: float = 20.0) -> dict:
    """Tokens/s of one process training the whole model; stops early (after at least 10 steps)
    once `budget_s` is spent, which only happens when another job is taking the cores."""
    import torch

    from roles.model.stage import FullModel, StageModel
    from roles.trainer.data import make_sample_stream

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        stages = [StageModel(run, s) for s in range(run.num_stages)]
        model = FullModel.from_stages(stages)
        opt = run.optimizer
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opt.lr,
                                      betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
        samples = iter(make_sample_stream("synthetic", None, run.seq_len, 0, 1, run.seed, epochs=None))
        batch = run.target_batch_size
        losses: list[float] = []
        step_s: list[float] = []

        def step() -> None:
            tokens = torch.stack([next(samples).tokens for _ in range(batch)])
            loss = model(tokens).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for index, stage in enumerate(stages):  # the swarm clips per stage [report 4.3]; so do we
                torch.nn.utils.clip_grad_norm_(stage.trainable_parameters(), run.clip_threshold(index))
            optimizer.step()
            losses.append(float(loss.detach()))

        for _ in range(warmup_steps):
            step()
        meter = CpuMeter()
        started = time.perf_counter()
        for i in range(steps):
            if i >= 10 and time.perf_counter() - started > budget_s:
                break
            t = time.perf_counter()
            step()
            step_s.append(time.perf_counter() - t)
        wall = time.perf_counter() - started
        planned, steps = steps, len(step_s)
        load = meter.read()
        block = 10
        blocks = [sum(step_s[i:i + block]) / len(step_s[i:i + block]) for i in range(0, len(step_s), block)]
    finally:
        torch.set_num_threads(previous_threads)
    tokens = steps * batch * run.seq_len
    return {
        "tokens_per_s": round(tokens / wall, 1),
        "steps": steps,
        "steps_planned": planned,
        "warmup_steps": warmup_steps,
        "batch_samples": batch,
        "seq_len": run.seq_len,
        "wall_s": round(wall, 3),
        "step_ms": round(wall / steps * 1000, 2),
        "step_ms_p50": round(statistics.median(step_s) * 1000, 2),
        "tokens_per_s_at_median_step": round(batch * run.seq_len / statistics.median(step_s), 1),
        "tokens_per_s_best_10_step_block": round(batch * run.seq_len / min(blocks), 1),
        "torch_threads": threads,
        "cpu_during_measurement": load,
        "loss_first_last": [round(losses[0], 3), round(losses[-1], 3)],
        "method": (
            "3 StageModels built in this process from the same run config, chained with FullModel (full residual "
            "stream, no boundary compression, no recomputation), AdamW with the run's hyperparameters and "
            f"per-stage clipping; torch.set_num_threads({threads}); each step draws target_batch_size samples from "
            f"the same synthetic stream (inside the timed loop); tokens/s over {steps} steps after {warmup_steps} "
            f"warm-up steps (at most {planned} steps, cut short after {budget_s:.0f}s)."
        ),
    }


# ---------------------------------------------------------------------------------------------
# the swarm: a probe on the seed node's libp2p daemon that reads worker counters and DHT records
# ---------------------------------------------------------------------------------------------

class SwarmProbe:
    """Reads the swarm from the benchmark's own seed DHT node: workers' `agora/v1/info` over our
    RpcClient, trainers' records from the DHT."""

    def __init__(self, membership, peer_id: str, run):
        self.membership = membership
        self.peer_id = peer_id
        self.run = run
        self.p2p = None
        self.client = None
        self.dht = None
        self._connected: set[str] = set()

    async def open(self) -> None:
        from protocol.dht import SwarmDHT
        from protocol.transport import RpcClient

        self.p2p = await self.membership.dht.replicate_p2p()
        self.client = RpcClient(self.p2p, timeout_s=10.0)
        self.dht = SwarmDHT(self.membership.dht, self.peer_id)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def info(self, node) -> dict:
        """One worker's InfoReply (as a dict), with the local time the reply came back."""
        from hivemind.p2p import PeerID

        from protocol import hivemind_adapter, version

        peer = PeerID.from_base58(node.peer_id)
        if node.peer_id not in self._connected:
            await asyncio.wait_for(hivemind_adapter.connect(self.p2p, peer, dialable_maddrs(node.maddrs)), 10.0)
            self._connected.add(node.peer_id)
        sent = time.monotonic()
        reply = await self.client.call(peer, version.INFO, {}, timeout_s=10.0)
        received = time.monotonic()
        reply["_at"] = (sent + received) / 2
        reply["_rtt_ms"] = (received - sent) * 1000
        return reply

    async def trainer_records(self) -> dict:
        from protocol.dht_schema import TrainerRecord, trainers_key

        return await self.dht.get(trainers_key(self.run.run_id), TrainerRecord)


def _check_alive(nodes, during: str) -> None:
    dead = [n for n in nodes if n.proc.poll() is not None]
    if dead:
        raise RuntimeError(f"{', '.join(n.name for n in dead)} exited during {during} "
                           f"(code {dead[0].proc.returncode}):\n{dead[0].log_tail(8)}")


async def _snapshot(probe: SwarmProbe, workers, trainers) -> dict:
    _check_alive([*workers, *trainers], "the measurement")
    infos = await asyncio.gather(*(probe.info(w) for w in workers))
    records = await probe.trainer_records()
    nodes = [*workers, *trainers]
    cpu = {n.name: cpu_by_part(n.pid) for n in nodes}
    node_pids = {p.pid for n in nodes for p in process_tree(n.pid)}
    return {"infos": infos, "records": records, "cpu": cpu, "own_cpu": own_cpu_seconds(node_pids),
            "busy": system_busy_s(), "at": time.monotonic()}


async def _wait_warm(probe: SwarmProbe, workers, trainers, warmup_samples: int, warmup_s: float,
                     timeout_s: float = 120.0) -> dict:
    """Wait until the head worker has completed `warmup_samples` more backward passes and at
    least `warmup_s` seconds have passed; those samples are discarded from the measurement."""
    head = workers[0]
    base = (await probe.info(head))["counters"].get("backward_requests", 0)
    started = time.monotonic()
    wanted = {t.peer_id for t in trainers}
    while True:
        _check_alive([*workers, *trainers], "warm-up")
        done = (await probe.info(head))["counters"].get("backward_requests", 0) - base
        elapsed = time.monotonic() - started
        if done >= warmup_samples and elapsed >= warmup_s:
            records = await probe.trainer_records()
            if wanted <= set(records) and all(records[p].samples_completed > 0 for p in wanted):
                return {"warmup_samples_seen": done, "warmup_s": round(elapsed, 2)}
        if elapsed > timeout_s:
            raise RuntimeError(f"no steady training after {timeout_s:.0f}s ({done} samples at the head)")
        await asyncio.sleep(0.25)


def _window_result(run, workers, trainers, first: dict, last: dict) -> dict:
    wall = last["at"] - first["at"]
    per_stage = {}
    for node, a, b in zip(workers, first["infos"], last["infos"]):
        ca, cb = a["counters"], b["counters"]
        d = {k: cb.get(k, 0) - ca.get(k, 0) for k in
             ("compute_ms", "forward_requests", "forward_batches", "backward_requests", "backward_batches",
              "backward_kept")}
        span_ms = (b["_at"] - a["_at"]) * 1000
        per_stage[str(node.stage)] = {
            "utilization": rounded(d["compute_ms"] / span_ms),
            "compute_ms": d["compute_ms"],
            "wall_ms": round(span_ms),
            "forward_requests": d["forward_requests"],
            "backward_requests": d["backward_requests"],
            # of those, run through the forward's kept graph instead of recomputing it
            "backward_kept": d["backward_kept"],
            "mean_forward_batch": rounded(d["forward_requests"] / d["forward_batches"], 2) if d["forward_batches"] else None,
            "mean_backward_batch": rounded(d["backward_requests"] / d["backward_batches"], 2) if d["backward_batches"] else None,
            "optimizer_steps": b.get("local_step", 0) - a.get("local_step", 0),
            "rejected": {k: v for k, v in cb.items() if k.startswith("rejected_") and v},
        }
    record_rates = {}
    for t in trainers:
        r0, r1 = first["records"].get(t.peer_id), last["records"].get(t.peer_id)
        if r0 is None or r1 is None or r1.time <= r0.time:
            record_rates[t.name] = None
            continue
        record_rates[t.name] = (r1.tokens - r0.tokens) / (r1.time - r0.time)
    head = per_stage[str(workers[0].stage)]
    head_rate = head["backward_requests"] * run.seq_len / (head["wall_ms"] / 1000)
    if all(v is not None for v in record_rates.values()):
        tokens_per_s, source = sum(record_rates.values()), "trainer_dht_records"
    else:
        tokens_per_s, source = head_rate, "head_worker_backward_counter"
    by_kind = {"worker_node_processes": 0.0, "trainer_node_processes": 0.0, "dht_processes": 0.0, "p2pd": 0.0,
               "other": 0.0}
    cpu = {}
    for node in [*workers, *trainers]:
        a, b = first["cpu"][node.name], last["cpu"][node.name]
        delta = {k: max(0.0, b.get(k, 0.0) - a.get(k, 0.0)) for k in b}
        cpu[node.name] = rounded(sum(delta.values()) / wall, 3)
        by_kind[f"{node.role}_node_processes"] += delta["node"] / wall
        by_kind["dht_processes"] += delta["dht_process"] / wall
        by_kind["p2pd"] += delta["p2pd"] / wall
        by_kind["other"] += delta["other"] / wall
    cpu["benchmark_and_seed_dht"] = rounded((last["own_cpu"] - first["own_cpu"]) / wall, 3)
    ours = sum(v for v in cpu.values() if v is not None)
    machine = (last["busy"] - first["busy"]) / wall
    cpu["foreign"] = rounded(max(0.0, machine - ours), 3)  # other work on this machine in the window
    cpu["machine_busy"] = rounded(machine, 3)
    utils = [s["utilization"] for s in per_stage.values()]
    return {
        "tokens_per_s": round(tokens_per_s, 1),
        "tokens_per_s_source": source,
        "tokens_per_s_by_trainer": {k: rounded(v, 1) for k, v in record_rates.items()},
        "tokens_per_s_head_counter": round(head_rate, 1),
        "window_s": round(wall, 2),
        "mean_utilization": rounded(statistics.fmean(utils)),
        "per_stage": per_stage,
        "cpu_cores_used": {**cpu, "ours_total": rounded(ours, 3)},
        "cpu_cores_by_process_kind": {k: rounded(v, 3) for k, v in by_kind.items()},
    }


async def measure_idle_cpu(workers, window_s: float) -> dict:
    """CPU the workers burn with no trainer at all: DHT announcements and stage-progress ticks,
    the swarm's fixed cost that training traffic comes on top of."""
    await asyncio.sleep(1.0)  # let start-up work (first announcements, bootstrap) pass
    node_pids = {p.pid for n in workers for p in process_tree(n.pid)}
    first = {n.name: cpu_by_part(n.pid) for n in workers}
    own, busy, at = own_cpu_seconds(node_pids), system_busy_s(), time.monotonic()
    await asyncio.sleep(window_s)
    wall = time.monotonic() - at
    last = {n.name: cpu_by_part(n.pid) for n in workers}
    kinds = {"worker_node_processes": "node", "dht_processes": "dht_process", "p2pd": "p2pd", "other": "other"}
    result = {kind: rounded(sum(last[n][part] - first[n][part] for n in last) / wall, 3) for kind, part in kinds.items()}
    ours = sum(result.values())
    result["benchmark_and_seed_dht"] = rounded((own_cpu_seconds(node_pids) - own) / wall, 3)
    result["foreign"] = rounded(max(0.0, (system_busy_s() - busy) / wall - ours - result["benchmark_and_seed_dht"]), 3)
    result["window_s"] = rounded(wall, 2)
    result["method"] = ("3 workers up, no trainer; user+system CPU of each worker's process tree over the window, "
                        "split into the agora-node process, hivemind's DHT process, p2pd and other children")
    return result


async def measure_trainers(swarm, probe: SwarmProbe, run, workers, *, trainers: int, lanes: int,
                           windows: Windows, window_s: float, sample_rss: bool = False,
                           config: Optional[str] = None) -> dict:
    """Start `trainers` trainers with `lanes` lanes each against the running workers, warm up,
    measure one steady window, then stop them (sampling the first trainer's memory just before).
    `config`: another run-config file of the same run for the trainers (its routing path)."""
    nodes = [
        swarm.start("trainer", name=f"trainer-l{lanes}x{trainers}-{i}", wait_ready=False, args=[
            "--lanes", str(lanes), "--shard-index", str(i), "--num-shards", str(trainers),
            "--discovery-period-s", "2", "--announce-period-s", "1", *(["--config", config] if config else [])])
        for i in range(trainers)
    ]
    result: dict[str, Any] = {"trainers": trainers, "lanes_per_trainer": lanes, "lanes_total": trainers * lanes}
    try:
        started = time.monotonic()
        for node in nodes:
            await asyncio.to_thread(swarm.wait_ready, node, 120.0)
        result["trainer_start_s"] = round(time.monotonic() - started, 2)
        result["warmup"] = await _wait_warm(probe, workers, nodes, windows.warmup_samples, windows.warmup_s)
        first = await _snapshot(probe, workers, nodes)
        await asyncio.sleep(window_s)
        last = await _snapshot(probe, workers, nodes)
        result.update(_window_result(run, workers, nodes, first, last))
        if sample_rss:
            result["trainer_memory"] = memory_of(nodes[0].pid)
    finally:
        for node in nodes:
            await asyncio.to_thread(swarm.stop, node)
    summaries = []
    for node in nodes:
        deadline = time.monotonic() + 3.0
        summary = node.summary()
        while summary is None and time.monotonic() < deadline:  # the stdout pump may lag the exit
            await asyncio.sleep(0.05)
            summary = node.summary()
        summaries.append(summary)
    result["trainer_summaries"] = [
        None if s is None else {k: s.get(k) for k in ("samples_completed", "samples_dropped", "dropped_by_reason",
                                                      "tokens_per_s", "wall_s", "forward_retries",
                                                      "backward_fallbacks", "last_loss", "routing")}
        for s in summaries
    ]
    return result


def _routing_config(swarm, path: str) -> str:
    """The swarm's run-config file with `routing.path` set to `path`, written beside it."""
    from protocol.run_config import dump_run_config, load_run_config

    run = load_run_config(swarm.config)
    target = os.path.join(os.path.dirname(swarm.config), f"run-{path}.yaml")
    dump_run_config(run.model_copy(update={"routing": run.routing.model_copy(update={"path": path})}), target)
    return target


# ---------------------------------------------------------------------------------------------
# metrics cost: the same swarm, windows scraped every second and windows not scraped, alternating
# ---------------------------------------------------------------------------------------------

async def start_workers(swarm, run) -> list:
    """One worker per stage, each with a metrics port (idle until something scrapes it)."""
    workers = [swarm.start("worker", stage=s, wait_ready=False,
                           args=["--max-batch", str(WORKER_MAX_BATCH), "--metrics-port", "0"])
               for s in range(run.num_stages)]
    for node in workers:
        await asyncio.to_thread(swarm.wait_ready, node, 120.0)
    return workers


def _metrics_port(node) -> Optional[tuple[str, int]]:
    from protocol.readiness import parse_ready_line

    for line in node.stdout_lines:
        fields = parse_ready_line(line)
        if fields is not None and fields.get("metrics"):
            host, port = fields["metrics"].removeprefix("http://").rsplit(":", 1)
            return host, int(port)
    return None


_SCRAPE_SUM = re.compile(rb"^agora_metrics_scrape_seconds_sum\{[^}]*\} (\S+)$", re.MULTILINE)


async def _scrape_once(address: tuple[str, int]) -> bytes:
    """GET /metrics over a fresh connection (as Prometheus does by default); the reply."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), 10.0)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10.0)
    finally:
        writer.close()
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"scrape of {address} answered {data[:60]!r}")
    return data


class Scraper:
    """Scrapes every node every `period_s` while `active`: a Prometheus at 1 s, pessimistic
    (15 s to 60 s is usual); it runs in this process, on this machine's cores, so its own CPU
    counts against the swarm too."""

    def __init__(self, nodes, period_s: float = 1.0):
        self.addresses = [a for a in (_metrics_port(n) for n in nodes) if a is not None]
        self.period_s = period_s
        self.active = False
        self.latencies_ms: list[float] = []
        self.sizes: list[int] = []
        self.errors = 0
        self.build_s: dict[tuple[str, int], float] = {}
        """Per node, the seconds it reports having spent building its replies (agora_metrics_scrape_seconds)."""

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            if self.active:
                async def one(address):
                    t = time.perf_counter()
                    try:
                        data = await _scrape_once(address)
                        self.latencies_ms.append((time.perf_counter() - t) * 1000)
                        self.sizes.append(len(data))
                        found = _SCRAPE_SUM.search(data)
                        if found:
                            self.build_s[address] = float(found.group(1))
                    except Exception:  # noqa: BLE001 - counted; the measurement goes on
                        self.errors += 1
                await asyncio.gather(*(one(a) for a in self.addresses))
            await asyncio.sleep(max(0.0, self.period_s - (time.monotonic() - started)))


def _compute_per_request_us(result: dict) -> Optional[float]:
    """Compute time per request at the stage where it is smallest (where recording weighs most)."""
    values = []
    for stage in result["per_stage"].values():
        requests = stage["forward_requests"] + stage["backward_requests"]
        if requests:
            values.append(stage["compute_ms"] * 1000 / requests)
    return min(values) if values else None


def recording_cost_us(samples: int = 20000, batch: int = 8) -> float:
    """What the compute thread pays per request to record the balance signals (BatchStats.record
    on a batch of `batch`), in microseconds: paid whether or not the node is scraped."""
    from roles.worker.serving.queues import Task, TaskKind
    from roles.worker.serving.compute_stats import BatchStats

    stats = BatchStats(WORKER_MAX_BATCH)
    tasks = [Task(kind=TaskKind.BACKWARD, payload=None, on_done=lambda r, e: None) for _ in range(batch)]
    started = time.perf_counter()
    for _ in range(samples // batch):
        now = time.monotonic()
        stats.record(tasks, now, 0.0, 0.001)
    return (time.perf_counter() - started) / samples * 1e6


async def measure_metrics_cost(swarm, probe: SwarmProbe, run, workers, windows: Windows) -> dict:
    """Two trainers x 4 lanes train continuously while windows alternate between every node being
    scraped each second ('on') and nobody scraping ('off'), in ABBA order so a drift in machine
    load hits both alike; tokens/s per window as in (a). Every node has its metrics port in both
    (an unscraped port is an idle socket on the event loop; what metrics cost is the scrapes, plus
    the recording of the balance signals, paid with or without the port and reported beside)."""
    lanes = windows.swarm_lanes_per_trainer
    trainers = [
        swarm.start("trainer", name=f"trainer-metrics-{i}", wait_ready=False, args=[
            "--lanes", str(lanes), "--shard-index", str(i), "--num-shards", "2", "--discovery-period-s", "2",
            "--announce-period-s", "1", "--metrics-port", "0"])
        for i in range(2)
    ]
    scraper = None
    task = None
    windows_seen: dict[str, list[dict]] = {"on": [], "off": []}
    try:
        for node in trainers:
            await asyncio.to_thread(swarm.wait_ready, node, 120.0)
        await _wait_warm(probe, workers, trainers, windows.warmup_samples, windows.warmup_s)
        scraper = Scraper([*workers, *trainers])
        task = asyncio.create_task(scraper.run())
        for pair in range(windows.metrics_pairs):
            for mode in (("off", "on") if pair % 2 == 0 else ("on", "off")):
                scraper.active = mode == "on"
                await asyncio.sleep(1.0 if mode == "on" else 0.5)  # the first scrapes land / the last end
                first = await _snapshot(probe, workers, trainers)
                built_first = dict(scraper.build_s)
                await asyncio.sleep(windows.metrics_window_s)
                last = await _snapshot(probe, workers, trainers)
                built = sum(v - built_first.get(a, v) for a, v in scraper.build_s.items())
                result = _window_result(run, workers, trainers, first, last)
                windows_seen[mode].append({k: result[k] for k in ("tokens_per_s", "tokens_per_s_source", "window_s",
                                                                   "mean_utilization")}
                                          | {"cpu_cores_ours": result["cpu_cores_used"]["ours_total"],
                                             "cpu_foreign": result["cpu_cores_used"]["foreign"],
                                             "compute_us_per_request": _compute_per_request_us(result),
                                             "benchmark_process_cores": result["cpu_cores_used"][
                                                 "benchmark_and_seed_dht"],
                                             "nodes_building_scrapes_cores": rounded(built / result["window_s"],
                                                                                     5)})
                log(f"  metrics {mode}: {result['tokens_per_s']:.0f} tokens/s")
        scraper.active = False
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for node in trainers:
            await asyncio.to_thread(swarm.stop, node)

    def mean(mode: str, key: str) -> Optional[float]:
        values = [w[key] for w in windows_seen[mode] if w[key] is not None]
        return statistics.fmean(values) if values else None

    on, off = mean("on", "tokens_per_s"), mean("off", "tokens_per_s")
    spread = [w["tokens_per_s"] for w in windows_seen["off"] if w["tokens_per_s"] is not None]
    building = mean("on", "nodes_building_scrapes_cores")
    cores = mean("on", "cpu_cores_ours")
    per_request_us = recording_cost_us()
    compute_us = mean("off", "compute_us_per_request")
    return {
        "tokens_per_s_metrics_off": rounded(off, 1),
        "tokens_per_s_metrics_on": rounded(on, 1),
        "ratio_on_over_off": rounded(on / off, 4) if on and off else None,
        "cost": rounded(1 - on / off, 4) if on and off else None,
        "noise_off_windows_stdev_over_mean": rounded(statistics.pstdev(spread) / statistics.fmean(spread), 4)
        if len(spread) > 1 else None,
        "scrape_cpu_share": rounded(building / cores, 5) if building is not None and cores else None,
        "windows": windows_seen,
        "scrapes": {"count": len(scraper.latencies_ms) if scraper else 0,
                    "errors": scraper.errors if scraper else None,
                    "nodes_scraped": len(scraper.addresses) if scraper else 0,
                    "latency_ms_p50": rounded(percentile(scraper.latencies_ms, 0.5), 2) if scraper else None,
                    "latency_ms_p95": rounded(percentile(scraper.latencies_ms, 0.95), 2) if scraper else None,
                    "bytes_p50": rounded(percentile(scraper.sizes, 0.5), 0) if scraper else None},
        "recording_us_per_request": rounded(per_request_us, 3),
        "compute_us_per_request_min_stage": rounded(compute_us, 1),
        "recording_share_of_compute": rounded(per_request_us / compute_us, 5) if compute_us else None,
        "method": (
            f"{run.num_stages} workers (one per stage) and 2 trainers x {lanes} lanes, every node with "
            "--metrics-port 0, training without pause; after the warm-up of (a), "
            f"{windows.metrics_pairs} pairs of {windows.metrics_window_s:.0f}s windows in ABBA order: 'on' = "
            "this process GETs /metrics from every node every second over a new connection (pessimistic: "
            "Prometheus usually scrapes every 15-60 s, from another machine; here the scraper's CPU is on the "
            "same 2 cores), 'off' = no scrapes. tokens/s per window as in (a) (trainers' DHT records); "
            "cost = 1 - mean(on) / mean(off); on a shared 2-core machine window-to-window noise "
            "(noise_off_windows_stdev_over_mean) is larger than 1%, so the CPU the nodes spend building their replies "
            "is reported as well: scrape_cpu_share = cores the nodes report spending in /metrics "
            "(agora_metrics_scrape_seconds) / cores the whole benchmark uses, in the 'on' windows (the swarm is "
            "CPU-bound, so its tokens/s falls by about that share). recording_us_per_request: what the compute thread pays per request "
            "to record the balance signals (BatchStats.record, batches of 8), paid with metrics on or off."
        ),
    }


# ---------------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------------

async def bench_metrics_only(windows: Windows, run, swarm, membership, peer_id: str, out: dict) -> None:
    """Only the metrics cost: workers, then the alternating windows."""
    t0 = time.monotonic()
    probe = SwarmProbe(membership, peer_id, run)
    try:
        await probe.open()
        log(f"[{time.monotonic() - t0:5.1f}s] starting {run.num_stages} workers")
        workers = await start_workers(swarm, run)
        log(f"[{time.monotonic() - t0:5.1f}s] metrics cost: {windows.metrics_pairs} pairs of "
            f"{windows.metrics_window_s:.0f}s windows, scraped and not")
        out["metrics_cost"] = await measure_metrics_cost(swarm, probe, run, workers, windows)
    finally:
        await probe.close()
        log(f"[{time.monotonic() - t0:5.1f}s] stopping every node")
        await asyncio.to_thread(swarm.stop_all)


async def bench_idle_only(windows: Windows, run, swarm, membership, peer_id: str, out: dict) -> None:
    """Only the idle swarm's CPU (`--only idle`), over a window long enough to cover the slow
    periods (announcements, forced progress records): 30 s unless `--idle-window-s` says."""
    t0 = time.monotonic()
    try:
        log(f"[{time.monotonic() - t0:5.1f}s] starting {run.num_stages} workers")
        workers = await start_workers(swarm, run)
        await asyncio.sleep(5.0)  # past start-up: first announcements, bootstrap, the first averaging checks
        log(f"[{time.monotonic() - t0:5.1f}s] idle workers: {windows.idle_window_s:.0f}s CPU")
        out["idle_swarm_cpu_cores"] = await measure_idle_cpu(workers, windows.idle_window_s)
    finally:
        log(f"[{time.monotonic() - t0:5.1f}s] stopping every node")
        await asyncio.to_thread(swarm.stop_all)


async def bench(windows: Windows, run, swarm, membership, peer_id: str, out: dict) -> None:
    """Fill `out` phase by phase, so a failure late in the run keeps what was measured before it.
    Every node is started through `swarm` (a LocalSwarm) and stopped before this returns."""
    t0 = time.monotonic()
    if not windows.only_swarm:
        log(f"[{time.monotonic() - t0:5.1f}s] (c) rpc overhead: {windows.rpc_round_trips} round trips each")
        out["rpc_overhead_ratio"] = await measure_rpc_overhead(run, windows.rpc_round_trips, windows.rpc_block)
    log(f"[{time.monotonic() - t0:5.1f}s] (a) centralized reference")
    central = measure_centralized(run, windows.central_steps, windows.central_warmup_steps,
                                  budget_s=windows.central_budget_s)
    one_thread = measure_centralized(run, max(10, windows.central_steps // 2), windows.central_warmup_steps, threads=1,
                                     budget_s=windows.central_budget_s / 2)
    central["diagnostic_1_thread"] = {k: one_thread[k] for k in ("tokens_per_s", "step_ms", "step_ms_p50",
                                                                "cpu_during_measurement")}
    out["swarm_vs_centralized"] = {"centralized": central}

    probe = SwarmProbe(membership, peer_id, run)
    try:
        await probe.open()
        log(f"[{time.monotonic() - t0:5.1f}s] starting {run.num_stages} workers")
        workers = await start_workers(swarm, run)
        if not windows.only_swarm:
            log(f"[{time.monotonic() - t0:5.1f}s] idle workers: {windows.idle_window_s:.0f}s CPU baseline")
            out["idle_swarm_cpu_cores"] = await measure_idle_cpu(workers, windows.idle_window_s)

        log(f"[{time.monotonic() - t0:5.1f}s] (a) swarm: 2 trainers x {windows.swarm_lanes_per_trainer} lanes, "
            f"{windows.swarm_window_s:.0f}s window")
        started = time.monotonic()
        swarm_run = await measure_trainers(swarm, probe, run, workers, trainers=2,
                                           lanes=windows.swarm_lanes_per_trainer, windows=windows,
                                           window_s=windows.swarm_window_s)
        overheads = [time.monotonic() - started - swarm_run["window_s"]]  # start, warm-up, stop
        rss_trend = {"after_swarm_run": {w.name: rss_mb(w.pid) for w in workers}}
        ratio = swarm_run["tokens_per_s"] / central["tokens_per_s"]
        best_central = max(central["tokens_per_s"], central["tokens_per_s_best_10_step_block"],
                           central["diagnostic_1_thread"]["tokens_per_s"])
        out["swarm_vs_centralized"] = {
            "ratio": rounded(ratio),
            "ratio_vs_fastest_centralized": rounded(swarm_run["tokens_per_s"] / best_central),
            "swarm_tokens_per_s": swarm_run["tokens_per_s"],
            "centralized_tokens_per_s": central["tokens_per_s"],
            "swarm": swarm_run,
            "centralized": central,
            "method": {
                "swarm": (
                    f"{out['config']['preset']} preset, {run.num_stages} stages x 1 worker (max_batch {WORKER_MAX_BATCH}), 2 trainers x "
                    f"{windows.swarm_lanes_per_trainer} lanes, every node torch_threads=1, all on 127.0.0.1; "
                    f"warm-up: at least {windows.warmup_samples} samples completed at the head worker and "
                    f"{windows.warmup_s:.0f}s after the trainers were ready, discarded; then tokens/s = sum over "
                    "trainers of (tokens_end - tokens_start) / (time_end - time_start) read from each trainer's "
                    f"signed DHT record (announced every 1s) at the start and end of a {windows.swarm_window_s:.0f}s "
                    "window; tokens_per_s_head_counter (head backward count x seq_len / window) is a cross-check."
                ),
                "centralized": central["method"],
                "ratio": "swarm tokens/s / centralized tokens/s, same global batch (target_batch_size) and seq_len",
                "ratio_vs_fastest_centralized": (
                    "swarm tokens/s / the best centralized rate seen (2 threads over all steps, its fastest 10-step "
                    "block, or 1 thread): robust to another job stealing a core during the reference, which hurts "
                    "the 2-thread reference far more than the swarm"),
            },
        }

        if "workers" in windows.routing:
            log(f"[{time.monotonic() - t0:5.1f}s] (a) the same, worker-to-worker routing")
            workers_config = _routing_config(swarm, "workers")
            started = time.monotonic()
            chained = await measure_trainers(swarm, probe, run, workers, trainers=2,
                                             lanes=windows.swarm_lanes_per_trainer, windows=windows,
                                             window_s=windows.swarm_window_s, config=workers_config)
            overheads.append(time.monotonic() - started - chained["window_s"])
            out["swarm_vs_centralized"]["workers_path"] = {
                "ratio": rounded(chained["tokens_per_s"] / central["tokens_per_s"]),
                "ratio_vs_fastest_centralized": rounded(chained["tokens_per_s"] / best_central),
                "swarm_tokens_per_s": chained["tokens_per_s"],
                "vs_trainer_path": rounded(chained["tokens_per_s"] / swarm_run["tokens_per_s"]),
                "swarm": chained,
                "method": ("as `swarm` above, on the same workers right after it, with the trainers' run config "
                           "saying routing.path: workers (each stage's worker passes the sample to the next)"),
            }

        if windows.only_swarm:
            return
        runs = []
        for i, lanes in enumerate(LANES):
            # On a busy machine, starting and stopping trainers slows down: shorten the windows
            # rather than overrun the time budget.
            per_run = (windows.deadline_s - (time.monotonic() - t0)) / (len(LANES) - i)
            window = max(3.0, min(windows.lanes_window_s, per_run - statistics.fmean(overheads)))
            log(f"[{time.monotonic() - t0:5.1f}s] (b) 1 trainer x {lanes} lane(s), {window:.0f}s window")
            started = time.monotonic()
            runs.append(await measure_trainers(swarm, probe, run, workers, trainers=1, lanes=lanes, windows=windows,
                                               window_s=window, sample_rss=lanes == 8))
            overheads.append(time.monotonic() - started - runs[-1]["window_s"])
            rss_trend[f"after_{lanes}_lanes"] = {w.name: rss_mb(w.pid) for w in workers}
        out["utilization_by_lanes"] = {
            "trainers": "one trainer process holding all the lanes",
            "runs": [
                {"lanes": r["lanes_total"], "mean_utilization": r["mean_utilization"],
                 "per_stage_utilization": {s: v["utilization"] for s, v in r["per_stage"].items()},
                 "tokens_per_s": r["tokens_per_s"],
                 "mean_forward_batch": {s: v["mean_forward_batch"] for s, v in r["per_stage"].items()},
                 "cpu_cores_used": r["cpu_cores_used"],
                 "cpu_cores_by_process_kind": r["cpu_cores_by_process_kind"], "window_s": r["window_s"],
                 "trainer_summary": r["trainer_summaries"][0]}
                for r in runs
            ],
            "method": (
                "workers stay up; for each lane count a fresh trainer is started, warmed up like (a), and each "
                "worker's agora/v1/info counters are read at the start and end of a "
                f"{windows.lanes_window_s:.0f}s window (shorter, see window_s, if the run was behind its time "
                "budget): utilization = delta compute_ms / wall ms between the two "
                "replies (compute_ms sums the duration of every batch the compute thread ran). tokens/s as in (a)."
            ),
        }
        trainer8 = next(r for r in runs if r["lanes_total"] == 8)

        log(f"[{time.monotonic() - t0:5.1f}s] metrics cost: {windows.metrics_pairs} pairs of "
            f"{windows.metrics_window_s:.0f}s windows, scraped and not")
        out["metrics_cost"] = await measure_metrics_cost(swarm, probe, run, workers, windows)

        worker_memory = {w.name: memory_of(w.pid) for w in workers}  # right before the workers stop
        worst = max(worker_memory.values(), key=lambda m: m.get("with_children_peak_rss_mb", 0))
        out["peak_rss_mb"] = {
            "worker": {"node_alone": worst.get("node_peak_rss_mb"),
                       "with_children": worst.get("with_children_peak_rss_mb"),
                       "with_children_pss_now": worst.get("with_children_pss_mb"),
                       "by_worker": worker_memory,
                       "current_rss_trend_mb": rss_trend},
            "trainer_8_lanes": {"node_alone": trainer8["trainer_memory"].get("node_peak_rss_mb"),
                                "with_children": trainer8["trainer_memory"].get("with_children_peak_rss_mb"),
                                "with_children_pss_now": trainer8["trainer_memory"].get("with_children_pss_mb"),
                                "detail": trainer8["trainer_memory"]},
            "method": (
                "VmHWM (peak RSS) from /proc/PID/status, sampled right before the node is stopped; 'node_alone' is "
                "the agora-node process, 'with_children' sums VmHWM over it and its descendants (hivemind's forked "
                "DHT process, p2pd, torch_shm_manager when torch started one), which double-counts pages the fork "
                "shares; 'with_children_pss_now' is the "
                "current proportional set size of the same tree (shared pages split). Worker: the largest of the "
                "stage workers after every run above. Trainer: one trainer with 8 lanes after its window."
            ),
        }
    finally:
        await probe.close()
        log(f"[{time.monotonic() - t0:5.1f}s] stopping every node")
        await asyncio.to_thread(swarm.stop_all)


def evaluate_aims(out: dict) -> dict:
    a = out.get("swarm_vs_centralized", {}).get("ratio")
    a_fast = out.get("swarm_vs_centralized", {}).get("ratio_vs_fastest_centralized")
    runs = out.get("utilization_by_lanes", {}).get("runs", [])
    best = max(runs, key=lambda r: r["mean_utilization"] or 0, default=None)
    c = out.get("rpc_overhead_ratio", {}).get("ratio")
    trainer = out.get("peak_rss_mb", {}).get("trainer_8_lanes", {})
    d = trainer.get("with_children")
    limit = AIMS["trainer_8_lanes_peak_rss_mb_max"]
    return {
        "targets": {
            "a_swarm_vs_centralized": f">= {AIMS['swarm_vs_centralized_min']}",
            "b_mean_utilization": f">= {AIMS['utilization_min_at_enough_lanes']} at some lane count",
            "c_rpc_overhead_ratio": f"<= {AIMS['rpc_overhead_ratio_max']}",
            "d_trainer_8_lanes_peak_rss_mb": f"< {AIMS['trainer_8_lanes_peak_rss_mb_max']} "
                                              "(node + children VmHWM sum)",
            "metrics_cost": f"<= {AIMS['metrics_cost_max']} of swarm tokens/s, every node scraped every second",
        },
        "metrics_cost_met": None if out.get("metrics_cost", {}).get("cost") is None
        else out["metrics_cost"]["cost"] <= AIMS["metrics_cost_max"],
        "metrics_scrape_cpu_share_met": None if out.get("metrics_cost", {}).get("scrape_cpu_share") is None
        else out["metrics_cost"]["scrape_cpu_share"] <= AIMS["metrics_cost_max"],
        "metrics_cost_resolvable": None if out.get("metrics_cost", {}).get("noise_off_windows_stdev_over_mean") is None
        else out["metrics_cost"]["noise_off_windows_stdev_over_mean"] <= AIMS["metrics_cost_max"],
        "a_met": None if a is None else a >= AIMS["swarm_vs_centralized_min"],
        "a_met_vs_fastest_centralized": None if a_fast is None else a_fast >= AIMS["swarm_vs_centralized_min"],
        "b_met": None if best is None else (best["mean_utilization"] or 0) >= AIMS["utilization_min_at_enough_lanes"],
        "b_best": None if best is None else {"lanes": best["lanes"], "mean_utilization": best["mean_utilization"]},
        "c_met": None if c is None else c <= AIMS["rpc_overhead_ratio_max"],
        "d_met": None if d is None else d < AIMS["trainer_8_lanes_peak_rss_mb_max"],
        "d_met_node_alone": None if trainer.get("node_alone") is None else trainer["node_alone"] < limit,
        "d_met_pss": None if trainer.get("with_children_pss_now") is None else trainer["with_children_pss_now"] < limit,
        "measured_on_a_busy_machine": _contention(out),
    }


def _contention(out: dict) -> dict:
    """Cores other work on this machine used during each measurement (not ours): above ~0.25 of
    2 cores the numbers above are pessimistic for the swarm and even more for the 2-thread
    centralized reference, whose OpenMP threads stall when a core is taken."""
    found = {}
    rpc = out.get("rpc_overhead_ratio", {}).get("cpu_during_measurement", {})
    found["rpc"] = rpc.get("foreign_cores")
    central = out.get("swarm_vs_centralized", {}).get("centralized", {})
    found["centralized"] = central.get("cpu_during_measurement", {}).get("foreign_cores")
    swarm = out.get("swarm_vs_centralized", {}).get("swarm", {})
    found["swarm"] = swarm.get("cpu_cores_used", {}).get("foreign")
    for r in out.get("utilization_by_lanes", {}).get("runs", []):
        found[f"lanes_{r['lanes']}"] = r["cpu_cores_used"].get("foreign")
    busy = {k: v for k, v in found.items() if v is not None and v > 0.25}
    return {"foreign_cores": found, "busy": bool(busy)}


def _gate(text: str) -> str:
    if text.lower() != "none" and not (text.isdigit()):
        raise argparse.ArgumentTypeError(f"a gate is a number of samples >= 0 or none, not {text!r}")
    return text


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short windows (CI smoke, ~1.5 min)")
    p.add_argument("--out", metavar="PATH", help="also write the JSON result to PATH")
    p.add_argument("--keep-logs", action="store_true", help="keep the node logs and print where they are")
    p.add_argument("--preset", choices=("tiny", "cpu-compute"), default="tiny",
                   help="the model: tiny (messaging-bound), or cpu-compute (each stage about 30 ms of forward and "
                        "backward per sample on one core)")
    p.add_argument("--idle-window-s", type=float, metavar="S",
                   help="seconds of the idle CPU window (default 5, or 30 with --only idle)")
    p.add_argument("--only", choices=("all", "metrics", "idle", "swarm"), default="all",
                   help="metrics: only the metrics-on vs metrics-off comparison (a few minutes); idle: only "
                        "the CPU of three idle workers (about a minute); swarm: only the centralized reference "
                        "and (a), for a point of the staleness frontier (about 3 minutes)")
    p.add_argument("--gate", metavar="N|none", type=_gate,
                   help="run config staleness.max_delayed_per_step (default: the preset's, 0); none: no gate")
    p.add_argument("--target-batch-size", type=int, metavar="N", help="run config target_batch_size")
    p.add_argument("--lanes", type=int, metavar="N", help="lanes per trainer in (a) (default 4)")
    p.add_argument("--metrics-pairs", type=int, metavar="N",
                   help="pairs of metrics-on/off windows (default 3); more pairs average out a noisy machine")
    p.add_argument("--metrics-window-s", type=float, metavar="S", help="seconds of each metrics window (default 10)")
    p.add_argument("--routing", choices=("both", "trainer"), default="both",
                   help="(a) with both routing paths side by side (default), or the trainer-driven one only")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    windows = QUICK if args.quick else FULL
    if args.metrics_pairs is not None or args.metrics_window_s is not None:
        windows = dataclasses.replace(windows, metrics_pairs=args.metrics_pairs or windows.metrics_pairs,
                                      metrics_window_s=args.metrics_window_s or windows.metrics_window_s)
    if args.routing == "trainer":
        windows = dataclasses.replace(windows, routing=("trainer",))
    if args.only == "swarm":
        windows = dataclasses.replace(windows, only_swarm=True)
    if args.lanes is not None:
        windows = dataclasses.replace(windows, swarm_lanes_per_trainer=args.lanes)
    overrides: dict[str, Any] = {}
    if args.gate is not None:
        overrides["staleness"] = {"max_delayed_per_step": None if args.gate.lower() == "none" else int(args.gate)}
    if args.target_batch_size is not None:
        overrides["target_batch_size"] = args.target_batch_size
    if args.idle_window_s is not None or args.only == "idle":
        windows = dataclasses.replace(windows, idle_window_s=args.idle_window_s or 30.0)
    started = time.monotonic()

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)

    run = bench_run_config(args.preset, overrides)
    out: dict[str, Any] = {"benchmark": "pipeline", "quick": args.quick, "machine": machine_info(),
                           "config": {"preset": args.preset, "stages": run.num_stages, "workers_per_stage": 1,
                                      "target_batch_size": run.target_batch_size, "seq_len": run.seq_len,
                                      "d_model": run.model.d_model, "subspace_rank": run.model.subspace_rank,
                                      "worker_max_batch": WORKER_MAX_BATCH, "node_torch_threads": 1,
                                      "max_delayed_per_step": run.staleness.max_delayed_per_step,
                                      "lanes_per_trainer": windows.swarm_lanes_per_trainer}}
    measure = {"all": bench, "metrics": bench_metrics_only, "idle": bench_idle_only, "swarm": bench}[args.only]
    errors = on_local_swarm(run, lambda *a: measure(windows, *a), out, keep_logs=args.keep_logs)
    out["aims"] = evaluate_aims(out)
    out["errors"] = errors
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    emit_report(out, args.out)
    return 1 if errors else 0


def on_local_swarm(run, measure, out: dict, *, keep_logs: bool = False, torch_threads: int = 1) -> list[str]:
    """Run `measure(run, swarm, membership, seed_peer_id, out)` (a coroutine function) against a
    LocalSwarm seeded by a DHT node of this process, then stop every node it started and check
    that none survived; returns the errors (an interrupt, the measurement's failure, survivors).
    Also used by scripts/bench_gpu.py."""
    from node.launcher import LocalSwarm
    from node.swarm import join_swarm
    from protocol.identity import load_or_create_identity
    from protocol.run_config import dump_run_config

    workdir = tempfile.mkdtemp(prefix="agora-bench-")
    config_path = os.path.join(workdir, "run.yaml")
    dump_run_config(run, config_path)
    errors: list[str] = []
    # The seed DHT forks hivemind's DHT process: start it before this process has any thread (docs/architecture.md, 'Processes and threads').
    identity = load_or_create_identity(None)
    membership = join_swarm(identity=identity, run_id=run.run_id, num_stages=run.num_stages, initial_peers=[],
                            host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[], bootstrap_timeout_s=30)
    os.unlink(identity.path)
    swarm = LocalSwarm(os.path.join(workdir, "logs"), config_path, torch_threads=torch_threads,
                       common_args=["--announce-period-s", "2"], initial_peers=membership.maddrs)
    try:
        asyncio.run(measure(run, swarm, membership, identity.peer_id.to_base58(), out))
    except KeyboardInterrupt:
        errors.append("interrupted")
    except Exception as exc:  # noqa: BLE001 - report what was measured, and the failure
        errors.append(f"{type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    finally:
        swarm.stop_all()  # idempotent; covers an interrupt during the async part
        _OWN_SHM_PIDS.extend([os.getpid(), membership.dht.pid])
        membership.shutdown()
        survivors = swarm.survivors()
        leaked = swarm.leaked_shared_memory() if hasattr(swarm, "leaked_shared_memory") else []
        out["cleanup"] = {"node_survivors": survivors, "seed_dht_alive": membership.dht.is_alive(),
                          "nodes_started": len(swarm.nodes),
                          "node_shm_segments_left": leaked,
                          "own_shm_segments": "removed at exit, see _exit_cleanly"}
        if survivors:
            errors.append(f"processes {survivors} survived shutdown")
        if errors or keep_logs:
            log(f"node logs: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return errors


_OWN_SHM_PIDS: list[int] = []


def _exit_cleanly(code: int) -> None:
    """hivemind's MPFutures keep torch shared memory (/dev/shm/torch_<pid>_*) in this process and
    the seed DHT process, and nothing unlinks it at exit. Unlinking it while this interpreter is
    alive makes torch abort when the buffer is finalized ("could not unlink the shared memory
    file"), so: flush, unlink our own segments, and leave without running finalizers."""
    sys.stdout.flush()
    sys.stderr.flush()
    remove_own_shared_memory(_OWN_SHM_PIDS)
    os._exit(code)


if __name__ == "__main__":
    _exit_cleanly(main())
