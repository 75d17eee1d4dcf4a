"""Stage checkpoints: the trainable parameters of one stage in a safetensors file, written
periodically by designated nodes and read by joiners [report 3.3.1.1].

Contributors load state from checkpoints rather than from the stable workers, to keep that load
off them; the report keeps them in cloud object storage, here it is a directory (which a sync
job or a mounted bucket can serve). A write must never leave a half-written file where a reader
looks: the file is written to a temporary name in the same directory, fsynced, renamed over the
old one with os.replace (atomic on POSIX), and the directory is fsynced. The metadata names the
run, the stage, the step and the parameter layout, so a reader refuses a file that does not fit.
Optimizer state is not included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from roles.periodic import every
from roles.worker.layout import FlatLayout, ParameterStore
from roles.worker.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = "agora-stage-v1"


def checkpoint_path(directory: str | os.PathLike[str], run_id: str, stage: int) -> Path:
    return Path(directory) / f"{run_id}-stage{stage}.safetensors"


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Atomically replace `path` with a safetensors file of `tensors` and `metadata`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a checkpoint is meant to be served to joiners
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class StageCheckpoints:
    """Saves and loads one stage's parameters; `run` writes periodically for designated nodes."""

    def __init__(self, directory: str, *, run_id: str, stage: int, layout: FlatLayout, store: ParameterStore):
        self.path = checkpoint_path(directory, run_id, stage)
        self.run_id = run_id
        self.stage = stage
        self.layout = layout
        self.store = store
        self.written = 0

    def save(self, step: int) -> Path:
        with self.store.lock:
            tensors = {name: tensor.detach().clone() for name, tensor in zip(self.layout.names, self.store.master_params)}
        metadata = {"format": FORMAT, "run_id": self.run_id, "stage": str(self.stage), "step": str(step),
                    "layout": self.layout.digest, "time": f"{time.time():.3f}"}
        write_checkpoint(self.path, tensors, metadata)
        self.written += 1
        return self.path

    def read_metadata(self) -> dict[str, str]:
        if not self.path.is_file():
            raise CheckpointError(f"no checkpoint at {self.path}")
        try:
            with safe_open(str(self.path), framework="pt") as handle:
                metadata = handle.metadata() or {}
        except Exception as exc:
            raise CheckpointError(f"{self.path} is not a readable safetensors file: {exc}") from exc
        expected = {"format": FORMAT, "run_id": self.run_id, "stage": str(self.stage), "layout": self.layout.digest}
        for key, value in expected.items():
            if metadata.get(key) != value:
                raise CheckpointError(f"{self.path} has {key}={metadata.get(key)!r}, this worker needs {value!r}")
        return metadata

    def load(self) -> int:
        """Copy the checkpoint's parameters into the stage; returns the step it was written at."""
        metadata = self.read_metadata()
        try:
            with safe_open(str(self.path), framework="pt") as handle:
                tensors = {name: handle.get_tensor(name) for name in self.layout.names}
        except Exception as exc:
            raise CheckpointError(f"{self.path} misses or garbles a tensor: {exc}") from exc
        with self.store.lock, torch.no_grad():
            for name, target in zip(self.layout.names, self.store.master_params):
                source = tensors[name]
                if source.shape != target.shape:
                    raise CheckpointError(f"{self.path}: {name} has shape {tuple(source.shape)}, "
                                          f"expected {tuple(target.shape)}")
                target.copy_(source)
            self.store.push_master_to_device()
        return int(metadata.get("step", "0"))

    async def run(self, stop: asyncio.Event, period_s: float, step_fn, may_write=lambda: True) -> None:
        """Write now (a fresh writer publishes its state at once), then every `period_s`; skip a
        write while `may_write()` is false (a writer in a sync phase holds stale weights)."""
        async def write() -> None:
            if may_write():
                await self.save_logged(step_fn())
            else:
                logger.info("checkpoint of stage %d skipped: this worker is still syncing", self.stage)

        await every(period_s, write, stop, name=f"checkpoint of stage {self.stage}")

    async def save_logged(self, step: int) -> Optional[Path]:
        try:
            path = await asyncio.to_thread(self.save, step)
        except Exception:  # noqa: BLE001 - a failed write must not stop the worker; the old file stays
            logger.exception("writing the checkpoint %s failed; the previous one is kept", self.path)
            return None
        logger.info("checkpoint of stage %d at step %d written to %s", self.stage, step, path)
        return path
