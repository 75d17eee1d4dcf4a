"""A worker's part in run checkpoints (roles/checkpoint_store.py): write its stage at every
agreed step if it is a designated writer, and load a stage's state from the store.

The stage object is serialized in the compute thread right after the step, under the optimizer's
lock, straight from the live tensors (no copy of the stage in memory: compute pauses for the
local write instead); a background thread uploads it, one at a time. A checkpoint that comes
while the previous one is still uploading is skipped and counted: the store falls one checkpoint
behind rather than the worker's memory or disk filling up. On shutdown the upload in progress
gets `close`'s timeout; one cut short leaves an incomplete checkpoint, which no reader loads.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from roles.checkpoint_store import (FORMAT, CheckpointStore, CheckpointStoreError, RunManifest, StageState,
                                    read_stage_state, stage_state_tensors, staging_dir, write_staged)
from roles.worker.errors import StateLoadError
from roles.worker.layout import FlatLayout

logger = logging.getLogger(__name__)

STORE_PARALLEL_READS = 4
"""Ranged reads a joiner keeps in flight to the checkpoint store (one connection each on S3)."""


class RunCheckpointWriter:
    def __init__(self, store: CheckpointStore, *, stage: int, writer: str, optimizer, layout: FlatLayout,
                 every_steps: int, keep: int, may_write: Callable[[], bool]):
        self.store = store
        self.stage = stage
        self.writer = writer
        self.optimizer = optimizer
        self.layout = layout
        self.every_steps = every_steps
        self.keep = keep
        self.may_write = may_write
        self.counters: collections.Counter[str] = collections.Counter()
        self.last_step: Optional[int] = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-upload")
        self._pending: Optional[concurrent.futures.Future] = None
        self._staging: Optional[Path] = None
        self._lock = threading.Lock()

    def after_step(self, step: int) -> None:
        """Compute thread, optimizer lock held, `step` steps applied: serialize at an agreed step."""
        if step <= 0 or step % self.every_steps:
            return
        if not self.may_write():
            self.counters["checkpoints_skipped_syncing"] += 1
            return
        with self._lock:
            if self._pending is not None and not self._pending.done():
                self.counters["checkpoints_skipped_busy"] += 1
                logger.warning("checkpoint of stage %d at step %d skipped: the upload of step %s is still running",
                               self.stage, step, self.last_step)
                return
            if self._staging is None:
                self._staging = staging_dir()
            path = self._staging / f"stage-{self.stage}-step{step}.safetensors"
            tensors, metadata = stage_state_tensors(self.layout.names, self.optimizer.master_params,
                                                    self.optimizer.state_dict())
            metadata.update({"format": FORMAT, "run_id": self.store.run_id, "stage": str(self.stage),
                             "step": str(step), "layout": self.layout.digest, "writer": self.writer,
                             "time": f"{time.time():.3f}"})
            started = time.perf_counter()
            try:
                write_staged(path, tensors, metadata)
            except Exception:  # noqa: BLE001 - a full disk must not stop the compute thread
                self.counters["checkpoint_upload_failures"] += 1
                logger.exception("writing the checkpoint of stage %d at step %d locally failed", self.stage, step)
                path.unlink(missing_ok=True)
                return
            self.counters["checkpoint_pause_ms"] += int((time.perf_counter() - started) * 1000)
            self.last_step = step
            self._pending = self._pool.submit(self._upload, step, path)

    def _upload(self, step: int, path: Path) -> None:
        started = time.monotonic()
        try:
            manifest = self.store.write_stage(step, self.stage, self.writer, path)
            if manifest is not None:
                self.store.prune(self.keep)
        except CheckpointStoreError as exc:
            self.counters["checkpoint_upload_failures"] += 1
            logger.error("%s; the store keeps its previous checkpoints", exc)
            return
        except Exception:  # noqa: BLE001 - a failed upload must not take the worker down
            self.counters["checkpoint_upload_failures"] += 1
            logger.exception("uploading the checkpoint of stage %d at step %d failed", self.stage, step)
            return
        self.counters["checkpoints_uploaded"] += 1
        logger.info("stage %d at step %d uploaded to %s in %.1fs%s", self.stage, step, self.store.describe(),
                    time.monotonic() - started, "; the checkpoint is complete" if manifest is not None else "")

    def close(self, timeout_s: float) -> None:
        """Give the upload in progress `timeout_s` to finish, then drop it (it stays incomplete)."""
        with self._lock:
            pending = self._pending
        if pending is not None and not pending.done():
            logger.info("waiting up to %.0fs for the checkpoint upload of step %s", timeout_s, self.last_step)
            try:
                pending.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                logger.warning("the checkpoint upload of step %s did not finish; that checkpoint stays incomplete "
                               "and is never loaded", self.last_step)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)

    def summary(self) -> dict:
        return {"store": self.store.describe(), "every_steps": self.every_steps, "last_step": self.last_step,
                **dict(self.counters)}


class StoreSource:
    """The checkpoint store as a chunk source of one stage object (state_download.py): each chunk
    is one ranged read, run in a thread (fsspec is blocking)."""

    def __init__(self, store: CheckpointStore, manifest: RunManifest, stage: int):
        self.store, self.run_manifest, self.stage = store, manifest, stage
        self.name = f"store {store.describe()}"
        self.entry = manifest.stages[stage]

    async def chunk(self, index: int) -> bytes:
        start = index * self.entry.chunk_bytes
        end = min(start + self.entry.chunk_bytes, self.entry.bytes)
        return await asyncio.to_thread(self.store.read_range, self.run_manifest, self.stage, start, end)


def fetch_stage_chunked(store: CheckpointStore, manifest: RunManifest, stage: int, workdir: Path, *,
                        parallel_reads: int = STORE_PARALLEL_READS, chunk_timeout_s: float = 120.0,
                        total_timeout_s: float = 3600.0) -> Path:
    """A local copy of one stage's object fetched by parallel ranged reads, each range checked
    against the SHA-256 its sidecar lists (a bad range is read again, not the whole object), then
    the whole object against its SHA-256. Blocking: call it off the event loop."""
    from roles.worker.state.state_download import MultiDonorDownload
    from roles.worker.state.state_snapshot import Manifest

    entry = manifest.stages[stage]
    if not entry.chunks:
        raise CheckpointStoreError(f"the stage {stage} object of step {manifest.step} lists no chunk hashes")
    chunks = Manifest(run_id=store.run_id, stage=stage, step=manifest.step, layout="", format=FORMAT,
                      total_bytes=entry.bytes, chunk_bytes=entry.chunk_bytes,
                      chunks=tuple(bytes.fromhex(c) for c in entry.chunks), manifest_id=entry.sha256)
    download = MultiDonorDownload(chunks, [StoreSource(store, manifest, stage)], chunk_timeout_s=chunk_timeout_s,
                                  total_timeout_s=total_timeout_s, inflight_per_source=parallel_reads,
                                  max_failures=parallel_reads + 2)
    try:
        blob, _ = asyncio.run(download.run())
    except StateLoadError as exc:
        raise CheckpointStoreError(f"fetching the stage {stage} object of step {manifest.step} from "
                                   f"{store.describe()} failed: {exc}") from exc
    if hashlib.sha256(blob).hexdigest() != entry.sha256:
        raise CheckpointStoreError(f"the stage {stage} object of step {manifest.step} does not match its manifest")
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"step{manifest.step}-{entry.file}"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    return path


def load_latest(store: CheckpointStore, stage: int, layout: FlatLayout,
                workdir: Path, *, ranged: Optional[bool] = None) -> Optional[tuple[RunManifest, StageState]]:
    """The state of `stage` in the newest complete checkpoint whose object of this stage is intact
    (a damaged one is logged and the next older tried), or None when the store has none. A store
    that cannot be listed raises CheckpointStoreError: the caller must not mistake it for an
    empty one. An object whose sidecar lists chunk hashes is fetched by parallel ranged reads
    (`ranged`, default: when the store is remote), an older one whole."""
    for step in reversed(store.complete_steps()):
        try:
            manifest = store.manifest(step)
            chunked = bool(manifest.stages[stage].chunks) and (not store.local if ranged is None else ranged)
            path = (fetch_stage_chunked(store, manifest, stage, workdir) if chunked
                    else store.fetch_stage(manifest, stage, workdir))
            try:
                state = read_stage_state(path, layout.names)
            finally:
                if chunked or not store.local:
                    path.unlink(missing_ok=True)
            for key, expected in (("run_id", store.run_id), ("stage", str(stage)), ("layout", layout.digest),
                                  ("step", str(manifest.step))):
                if state.metadata.get(key) != expected:
                    raise CheckpointStoreError(
                        f"the stage {stage} object of step {manifest.step} in {store.describe()} has "
                        f"{key}={state.metadata.get(key)!r}, this worker needs {expected!r}")
        except CheckpointStoreError as exc:
            logger.warning("skipping the checkpoint at step %d: %s", step, exc)
            continue
        return manifest, state
    return None


def apply_state(state: StageState, optimizer, layout: FlatLayout, *, with_optimizer: bool) -> None:
    """Copy a loaded state into the stage's StageOptimizer (its master weights, then the device):
    parameters, and the optimizer's moments, step and schedule position when `with_optimizer`."""
    with optimizer.lock, torch.no_grad():
        for name, target in zip(layout.names, optimizer.master_params):
            source = state.parameters[name]
            if source.shape != target.shape:
                raise CheckpointStoreError(f"{name} has shape {tuple(source.shape)} in the checkpoint, "
                                           f"expected {tuple(target.shape)}")
            target.copy_(source)
        optimizer.push_master_to_device()
        if with_optimizer and state.optimizer is not None:
            try:
                optimizer.load_state_dict(state.optimizer)
            except (ValueError, KeyError, RuntimeError) as exc:
                raise CheckpointStoreError(f"the checkpoint's optimizer state does not fit this stage: {exc}") from exc
