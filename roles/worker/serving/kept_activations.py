"""Forward activations kept for the backward, so a stage need not recompute its forward.

Without this, a head or body stage runs its forward under no_grad and the backward recomputes it
from the input the trainer sends back: a third of a stage's compute spent twice. With it, the
forward batch keeps its autograd graph; the backwards of its samples arrive one by one (in other
coalesced batches), wait here until every sample of that forward batch has its gradient (or was
abandoned by its trainer: a zero row), and then run one backward through the kept graph.

The graph is valid only on the weights it was built on. The stage's optimizer updates them in
place at every step, so a kept batch whose version is no longer the stage's step is dropped, and
its backwards recompute as before (on the pinned previous weights when those are still kept). A
batch whose samples do not all come back within PARK_S recomputes too, as does one that would
pass the memory budget when it is made: recompute is always the fallback, never an error.

Threads: the compute thread keeps, parks and takes; the event loop abandons samples and withdraws
parked requests whose caller left. One lock guards the lot.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from protocol.run_config import RunConfig
from roles.model.memory_plan import plan_memory
from roles.worker.config import WorkerConfig
from roles.worker.serving.queues import Superseded, Task

logger = logging.getLogger(__name__)

PARK_S = 1.0
"""How long a backward waits for the rest of its forward batch before it is recomputed alone."""
MAX_AGE_S = 30.0
"""A kept graph none of whose backwards came for this long is dropped (its trainer died)."""


@dataclass
class KeptBatch:
    """One forward batch's graph: its output (with grad_fn) and, for a body stage, its input leaf."""

    out: torch.Tensor
    coords: Optional[torch.Tensor]
    version: int
    rows: dict[str, int]
    """Sample id -> row of `out`."""
    nbytes: int
    parked: dict[str, Task] = field(default_factory=dict)
    abandoned: set[str] = field(default_factory=set)
    first_parked: Optional[float] = None
    created: float = field(default_factory=time.monotonic)
    step: Optional[int] = None
    """The step tag of its parked backwards (all must share it: one backward accumulates into one step)."""

    @property
    def complete(self) -> bool:
        return len(self.parked.keys() | self.abandoned) >= len(self.rows)


class SavedBytes:
    """Counts the bytes autograd saves for backward in a forward, not counting the stage's own
    parameters (saved by reference, they cost nothing more; `param_storages`: their storages'
    data pointers, which in-place optimizer steps leave unchanged)."""

    def __init__(self, param_storages: frozenset[int]):
        self._seen = set(param_storages)
        self.nbytes = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._seen:  # views of one storage (q, k and v of one projection) count once
            self._seen.add(ptr)
            self.nbytes += storage.nbytes()
        return tensor


class KeptActivations:
    """The forward batches kept on this worker, within `budget_bytes`."""

    def __init__(self, budget_bytes: int, park_s: float = PARK_S):
        self.budget_bytes = budget_bytes
        self.park_s = park_s
        self._lock = threading.Lock()
        self._batches: dict[int, KeptBatch] = {}
        self._by_sample: dict[str, int] = {}
        self._next_id = 0
        self.bytes_kept = 0
        self.counters: collections.Counter[str] = collections.Counter()
        """batches_kept, batches_over_budget, samples_backward_kept (ran through a kept graph),
        samples_recomputed_stale (a step came between), samples_recomputed_late (PARK_S passed),
        samples_recomputed_mixed (a forward batch's samples were tagged into two steps),
        samples_recomputed_unkept (no kept graph: over budget, or forwarded before a restart)."""

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def room_for(self, nbytes: int) -> bool:
        with self._lock:
            return self.bytes_kept + nbytes <= self.budget_bytes

    def keep(self, out: torch.Tensor, coords: Optional[torch.Tensor], version: int, sample_ids: list[str],
             nbytes: int) -> bool:
        """Keep a forward batch's graph; False (and nothing kept) when it would pass the budget."""
        with self._lock:
            if self.bytes_kept + nbytes > self.budget_bytes:
                self.counters["batches_over_budget"] += 1
                return False
            batch_id = self._next_id
            self._next_id += 1
            rows = {}
            for row, sample_id in enumerate(sample_ids):
                old = self._by_sample.pop(sample_id, None)
                if old is not None:  # a retried forward of the same sample: the newer one counts
                    self._forget_row(old, sample_id)
                rows[sample_id] = row
                self._by_sample[sample_id] = batch_id
            self._batches[batch_id] = KeptBatch(out=out, coords=coords, version=version, rows=rows, nbytes=nbytes)
            self.bytes_kept += nbytes
            self.counters["batches_kept"] += 1
            return True

    def _forget_row(self, batch_id: int, sample_id: str) -> None:
        batch = self._batches.get(batch_id)
        if batch is not None:
            batch.abandoned.add(sample_id)  # its row's gradient is zero: nobody will send one

    def take(self, tasks: list[Task], version: int) -> tuple[list[tuple[KeptBatch, list[Task]]], list[Task]]:
        """Sort a backward batch: tasks of a kept graph on the current weights `version` park until
        their forward batch is complete; complete batches come back with all their parked tasks
        (in row order) to run through the graph; the rest recompute."""
        ready: list[tuple[KeptBatch, list[Task]]] = []
        recompute: list[Task] = []
        superseded: list[Task] = []
        now = time.monotonic()
        with self._lock:
            touched: list[int] = []
            for task in tasks:
                sample_id = task.payload.sample_id
                batch_id = self._by_sample.get(sample_id)
                batch = None if batch_id is None else self._batches.get(batch_id)
                if batch is None:
                    self.counters["samples_recomputed_unkept"] += 1
                    recompute.append(task)
                    continue
                if batch.version != version:
                    self.counters["samples_recomputed_stale"] += 1
                    recompute.append(task)
                    continue  # the whole batch goes at the next `expire`
                if batch.parked and task.step != batch.step:  # its samples belong to two steps
                    self.counters["samples_recomputed_mixed"] += len(batch.parked) + 1
                    recompute.extend(self._release(batch_id))
                    recompute.append(task)
                    continue
                batch.step = task.step
                previous = batch.parked.get(sample_id)
                batch.parked[sample_id] = task
                if previous is not None:  # a retry of a parked backward replaces it (its caller left)
                    superseded.append(previous)
                if batch.first_parked is None:
                    batch.first_parked = now
                if batch_id not in touched:
                    touched.append(batch_id)
            for batch_id in touched:
                batch = self._batches.get(batch_id)
                if batch is not None and batch.complete:
                    ready.append((batch, self._release(batch_id)))
        for task in superseded:
            task.on_done(None, Superseded("a newer request for this sample arrived; this one is dropped"))
        return ready, recompute

    def due(self, version: int) -> tuple[list[tuple[KeptBatch, list[Task]]], list[Task]]:
        """Batches completed meanwhile (their last missing sample was abandoned) to run through
        their graph; and the parked tasks of graphs built on other weights than `version` (a step
        came between) or that waited PARK_S, to recompute (their graphs are dropped)."""
        ready: list[tuple[KeptBatch, list[Task]]] = []
        out: list[Task] = []
        now = time.monotonic()
        with self._lock:
            for batch_id, batch in list(self._batches.items()):
                if batch.version == version and batch.parked and batch.complete:
                    ready.append((batch, self._release(batch_id)))
                    continue
                stale = batch.version != version
                late = (now - batch.first_parked >= self.park_s if batch.first_parked is not None
                        else now - batch.created >= MAX_AGE_S)
                if not (stale or late):
                    continue
                tasks = self._release(batch_id)
                self.counters["samples_recomputed_stale" if stale else "samples_recomputed_late"] += len(tasks)
                out.extend(tasks)
        return ready, out

    def abandon(self, sample_id: str) -> None:
        """Its trainer dropped the sample: the batch completes without it (a zero row)."""
        with self._lock:
            batch_id = self._by_sample.get(sample_id)
            if batch_id is not None:
                self._forget_row(batch_id, sample_id)

    def withdraw(self, task: Task) -> bool:
        """The caller of a parked backward left: forget the task (its row waits for a retry)."""
        with self._lock:
            batch_id = self._by_sample.get(task.payload.sample_id)
            batch = None if batch_id is None else self._batches.get(batch_id)
            if batch is None or batch.parked.get(task.payload.sample_id) is not task:
                return False
            del batch.parked[task.payload.sample_id]
            return True

    def drain(self) -> list[Task]:
        """Every parked task (the worker stops: they are handed back), and drop every graph."""
        with self._lock:
            out: list[Task] = []
            for batch_id in list(self._batches):
                out.extend(self._release(batch_id))
            return out

    def parked(self) -> int:
        with self._lock:
            return sum(len(b.parked) for b in self._batches.values())

    def _release(self, batch_id: int) -> list[Task]:
        batch = self._batches.pop(batch_id)
        for sample_id in batch.rows:
            if self._by_sample.get(sample_id) == batch_id:
                del self._by_sample[sample_id]
        self.bytes_kept -= batch.nbytes
        return sorted(batch.parked.values(), key=lambda t: batch.rows[t.payload.sample_id])

    def summary(self) -> dict:
        with self._lock:
            return {"budget_bytes": self.budget_bytes, "bytes_kept": self.bytes_kept,
                    "batches_waiting": len(self._batches), **self.counters}


def kept_activations_budget(config: WorkerConfig, run: RunConfig, kind: str) -> int:
    """--kept-activations, or half of what the stage's memory plan leaves free on its device (host
    RAM on the CPU). The tail keeps nothing: its forward runs inside its backward."""
    import psutil

    if kind == "tail":
        return 0
    if config.kept_activations is not None:
        budget = config.kept_activations
    elif run.staleness.max_delayed_per_step != 0:
        # Forwards run ahead of the step, so one forward batch holds samples of two steps, whose
        # backwards cannot share its graph: measured slower than recomputing (demo, gate 4).
        logger.info("stage %d recomputes every forward in its backward (staleness.max_delayed_per_step is not 0; "
                    "--kept-activations SIZE keeps them anyway)", config.stage)
        return 0
    else:
        plan = plan_memory(run, config.stage, config.device, config.max_batch)
        device_free = None
        if config.device.startswith("cuda") and torch.cuda.is_available():
            # --gpu-memory on a card that is here: this worker's share of it
            device_free = config.gpu_memory or int(torch.cuda.mem_get_info(torch.device(config.device))[0])
        budget = plan.kept_activations_budget(device_free, int(psutil.virtual_memory().available))
    if budget:
        logger.info("stage %d keeps forward activations for the backward within %.2f GiB (recomputes beyond)",
                    config.stage, budget / 2**30)
    else:
        logger.info("stage %d recomputes every forward in its backward (no memory to keep activations)", config.stage)
    return budget
