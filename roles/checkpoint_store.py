"""Run checkpoints in a store: a directory or an object store (`file://`, `s3://`, `gs://`; fsspec).

A run checkpoint is every stage's parameters and optimizer state at one step that all stages
agree on without talking: the multiples of `checkpoints.every_steps` [report 3.3.1: contributors
"get the state from periodically refreshed checkpoints stored in cloud object storage"]. Each
designated writer uploads its stage at such a step as one safetensors object, then a small JSON
sidecar with the object's size and SHA-256. Whichever writer then finds every stage's sidecar
writes the run manifest, last: a checkpoint is complete only when its manifest is there, so a
reader never loads a half-uploaded one (an object without a sidecar, a sidecar without the other
stages). The same writer then deletes all but the newest `keep` complete checkpoints.

    <store>/<run_id>/step-000000050/stage-0.<writer>.safetensors   parameters + optimizer state
    <store>/<run_id>/step-000000050/stage-0.<writer>.json          its size, SHA-256 and chunks' SHA-256
    <store>/<run_id>/step-000000050/manifest.json                  every stage's object: written last

Writers name their objects after their peer id, so two replicas of a stage never overwrite each
other's object; the manifest takes the lowest id. Objects are safetensors (tensors and string
metadata, no pickle): a reader loads a store it does not control without running its code.
Every object is checked against its SHA-256 before a tensor of it is used. Sidecars and manifests
also list the SHA-256 of every STORE_CHUNK_BYTES chunk of the object, so a joiner can fetch it
with parallel ranged reads and check each range as it arrives (run_checkpoint_io.fetch_stage_chunked);
older checkpoints without them are fetched whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from protocol.errors import AgoraError
from protocol.files import atomic_write

__all__ = ["DEFAULT_STORE", "CheckpointStore", "CheckpointStoreError", "RunManifest", "StageEntry", "StageState",
           "read_stage_state", "stage_state_tensors"]

logger = logging.getLogger(__name__)

FORMAT = "agora-run-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_SIDECAR = re.compile(r"^stage-(\d+)\.([A-Za-z0-9]{1,128})\.json$")
_OPTIM_PREFIX = "optimizer.state."
_OUTER_PREFIX = "optimizer.outer."
"""An outer method's tensors (SparseLoCo's anchor: StageOptimizer.outer_state)."""


STORE_CHUNK_BYTES = 4 << 20
"""The chunks whose SHA-256 a sidecar lists: what one ranged read of a joiner fetches."""

DEFAULT_STORE = "~/.cache/agora-node/checkpoints"
"""The store when neither `--checkpoint-store` nor the run config's `checkpoints.store` names one: a
local directory, so a writer's run resumes on the same machine without any setup."""


def resolve_store_url(flag: Optional[str], configured: Optional[str]) -> str:
    """The store a node uses: its flag, else the run config's, else the local default."""
    url = flag or configured or DEFAULT_STORE
    return os.path.expanduser(url) if url.startswith("~") else url


class CheckpointStoreError(AgoraError):
    """The store cannot be reached, or what it holds is incomplete, damaged or of another run."""


@dataclass(frozen=True)
class StageEntry:
    stage: int
    file: str
    bytes: int
    sha256: str
    writer: str
    chunk_bytes: int = 0
    chunks: tuple[str, ...] = ()
    """SHA-256 (hex) of every `chunk_bytes` chunk of the object; empty in older checkpoints."""

    def to_json(self) -> dict:
        out = {"stage": self.stage, "file": self.file, "bytes": self.bytes, "sha256": self.sha256,
               "writer": self.writer}
        if self.chunks:
            out.update(chunk_bytes=self.chunk_bytes, chunks=list(self.chunks))
        return out

    @classmethod
    def from_json(cls, data: dict) -> StageEntry:
        chunks = tuple(str(c) for c in data.get("chunks", ()))
        chunk_bytes = int(data.get("chunk_bytes", 0))
        if chunks and (chunk_bytes <= 0 or len(chunks) != -(-int(data["bytes"]) // chunk_bytes)):
            raise ValueError(f"{len(chunks)} chunk hashes for {data['bytes']} bytes in chunks of {chunk_bytes}")
        return cls(stage=int(data["stage"]), file=str(data["file"]), bytes=int(data["bytes"]),
                   sha256=str(data["sha256"]), writer=str(data["writer"]), chunk_bytes=chunk_bytes, chunks=chunks)


@dataclass(frozen=True)
class RunManifest:
    run_id: str
    step: int
    stages: tuple[StageEntry, ...]
    written_at: float

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "run_id": self.run_id, "step": self.step, "written_at": self.written_at,
                           "stages": [s.to_json() for s in self.stages]}, indent=2, sort_keys=True) + "\n"


@dataclass
class StageState:
    """What a stage object holds: parameters by layout name, optimizer state, and its metadata."""

    parameters: dict[str, torch.Tensor]
    optimizer: Optional[dict[str, Any]]
    metadata: dict[str, str]


def stage_state_tensors(names: Sequence[str], params: Sequence[torch.Tensor],
                        optimizer_state: Optional[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Flatten a stage's parameters and its StageOptimizer.state_dict() into safetensors' tensors and
    string metadata. The tensors are the live ones: the caller holds the optimizer's lock until they
    are written."""
    tensors = {name: tensor.detach() for name, tensor in zip(names, params)}
    metadata: dict[str, str] = {}
    if optimizer_state is not None:
        torch_state = optimizer_state["optimizer"]
        other: dict[str, dict[str, Any]] = {}
        for index, values in torch_state["state"].items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{_OPTIM_PREFIX}{index}.{key}"] = value.detach()
                else:
                    other.setdefault(str(index), {})[key] = value
        for name, value in (optimizer_state.get("outer") or {}).items():
            tensors[f"{_OUTER_PREFIX}{name}"] = value.detach()
        metadata["optimizer"] = json.dumps({
            "version": optimizer_state["version"], "local_step": optimizer_state["local_step"],
            "samples_consumed": optimizer_state["samples_consumed"], "param_groups": torch_state["param_groups"],
            "other_state": other})
    return tensors, metadata


def read_stage_state(path: str | os.PathLike[str], names: Sequence[str]) -> StageState:
    """Load a stage object: `names` are the parameters expected (the stage's layout)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            keys = set(handle.keys())
            missing = [name for name in names if name not in keys]
            if missing:
                raise CheckpointStoreError(f"{path} misses parameter(s) {missing[:3]}")
            parameters = {name: handle.get_tensor(name) for name in names}
            optimizer = None
            if "optimizer" in metadata:
                info = json.loads(metadata["optimizer"])
                state: dict[int, dict[str, Any]] = {}
                for key in keys:
                    if key.startswith(_OPTIM_PREFIX):
                        index, name = key[len(_OPTIM_PREFIX):].split(".", 1)
                        state.setdefault(int(index), {})[name] = handle.get_tensor(key)
                for index, values in info.get("other_state", {}).items():
                    state.setdefault(int(index), {}).update(values)
                optimizer = {"version": info["version"], "local_step": info["local_step"],
                             "samples_consumed": info["samples_consumed"],
                             "optimizer": {"state": state, "param_groups": info["param_groups"]},
                             "outer": {key[len(_OUTER_PREFIX):]: handle.get_tensor(key)
                                       for key in sorted(keys) if key.startswith(_OUTER_PREFIX)}}
    except CheckpointStoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged object is refused in one sentence
        raise CheckpointStoreError(f"{path} is not a readable stage checkpoint: {exc}") from exc
    return StageState(parameters=parameters, optimizer=optimizer, metadata=metadata)


def _sha256(path: str | os.PathLike[str]) -> str:
    return _digests(path, 1 << 20)[0]


def _digests(path: str | os.PathLike[str], chunk_bytes: int) -> tuple[str, list[str]]:
    """The SHA-256 of a file and of each of its `chunk_bytes` chunks, in one read."""
    digest, chunks = hashlib.sha256(), []
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk_bytes), b""):
            digest.update(block)
            chunks.append(hashlib.sha256(block).hexdigest())
    return digest.hexdigest(), chunks


class CheckpointStore:
    """One run's checkpoints at `url`. The filesystem is opened on first use, not at construction
    (a worker forks its averager before any thread exists; s3fs starts one)."""

    def __init__(self, url: str, run_id: str, num_stages: int):
        self.url = url
        self.run_id = run_id
        self.num_stages = num_stages
        self._fs = None
        self._root = ""

    @property
    def fs(self):
        if self._fs is None:
            import fsspec

            try:
                self._fs, root = fsspec.core.url_to_fs(self.url)
            except (ImportError, ValueError) as exc:
                raise CheckpointStoreError(f"cannot open the checkpoint store {self.url}: {exc}") from exc
            self._root = f"{root.rstrip('/')}/{self.run_id}"
        return self._fs

    @property
    def local(self) -> bool:
        return type(self.fs).__name__ == "LocalFileSystem"

    def describe(self) -> str:
        return f"{self.url.rstrip('/')}/{self.run_id}"

    def _step_dir(self, step: int) -> str:
        self.fs  # noqa: B018 - sets _root
        return f"{self._root}/step-{step:09d}"

    # ---- writing ----

    def write_stage(self, step: int, stage: int, writer: str, staged: Path) -> Optional[RunManifest]:
        """Upload a stage object written locally at `staged` (it is moved or deleted), then its
        sidecar; then complete the checkpoint if every stage is there. Returns the manifest if this
        call completed the checkpoint."""
        if not re.fullmatch(r"[A-Za-z0-9]{1,128}", writer):
            raise ValueError(f"writer id {writer!r} must be 1-128 letters and digits")
        size, (sha, chunks) = staged.stat().st_size, _digests(staged, STORE_CHUNK_BYTES)
        directory = self._step_dir(step)
        name = f"stage-{stage}.{writer}.safetensors"
        try:
            self._put_file(staged, f"{directory}/{name}")
            entry = StageEntry(stage=stage, file=name, bytes=size, sha256=sha, writer=writer,
                               chunk_bytes=STORE_CHUNK_BYTES, chunks=tuple(chunks))
            self._put_bytes(f"{directory}/stage-{stage}.{writer}.json",
                            json.dumps({"format": FORMAT, "step": step, **entry.to_json()}).encode())
        except CheckpointStoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - network, credentials, disk full: one sentence
            raise CheckpointStoreError(f"uploading stage {stage} at step {step} to {self.describe()} failed: "
                                       f"{exc}") from exc
        finally:
            with contextlib.suppress(OSError):
                staged.unlink()
        return self.complete(step)

    def complete(self, step: int) -> Optional[RunManifest]:
        """Write the manifest of `step` if every stage's object is there and it has none yet."""
        directory = self._step_dir(step)
        fs = self.fs
        fs.invalidate_cache()
        if fs.exists(f"{directory}/{MANIFEST}"):
            return None
        chosen: dict[int, StageEntry] = {}
        for path in sorted(fs.ls(directory, detail=False)):
            match = _SIDECAR.match(path.rsplit("/", 1)[-1])
            if match is None:
                continue
            entry = self._sidecar(path, step)
            if entry is not None and (entry.stage not in chosen or entry.writer < chosen[entry.stage].writer):
                chosen[entry.stage] = entry
        if set(chosen) != set(range(self.num_stages)):
            return None
        manifest = RunManifest(run_id=self.run_id, step=step, written_at=round(time.time(), 3),
                               stages=tuple(chosen[s] for s in range(self.num_stages)))
        self._put_bytes(f"{directory}/{MANIFEST}", manifest.to_json().encode())
        logger.info("checkpoint at step %d complete in %s (%d stages)", step, self.describe(), self.num_stages)
        return manifest

    def _sidecar(self, path: str, step: int) -> Optional[StageEntry]:
        try:
            data = json.loads(self.fs.cat_file(path))
            entry = StageEntry.from_json(data)
        except Exception:  # noqa: BLE001 - a damaged sidecar only means that object does not count
            logger.warning("ignoring the unreadable checkpoint sidecar %s", path)
            return None
        if data.get("step") != step or not 0 <= entry.stage < self.num_stages:
            return None
        return entry

    def prune(self, keep: int) -> list[int]:
        """Delete every checkpoint, complete or not, older than the newest `keep` complete ones."""
        complete = self.complete_steps()
        if len(complete) <= keep:
            return []
        oldest_kept = complete[-keep]
        removed = []
        for step in self.steps():
            if step < oldest_kept:
                directory = self._step_dir(step)
                with contextlib.suppress(FileNotFoundError):
                    # the manifest first: a reader never finds a complete checkpoint missing objects
                    if self.fs.exists(f"{directory}/{MANIFEST}"):
                        self.fs.rm_file(f"{directory}/{MANIFEST}")
                    self.fs.rm(directory, recursive=True)
                removed.append(step)
        if removed:
            logger.info("deleted checkpoint(s) at step(s) %s from %s (keeping the newest %d)", removed,
                        self.describe(), keep)
        return removed

    def _put_file(self, local: Path, remote: str) -> None:
        fs = self.fs
        if self.local:  # a rename in the same directory: readers see all of it or nothing
            Path(remote).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{remote}.{os.getpid()}.tmp"
            shutil.copyfile(local, tmp)
            os.chmod(tmp, 0o644)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, remote)
        else:  # an object store's PUT (multipart or not) is atomic
            fs.put_file(str(local), remote)

    def _put_bytes(self, remote: str, data: bytes) -> None:
        if self.local:
            Path(remote).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(remote, data, mode=0o644)
        else:
            self.fs.pipe_file(remote, data)

    # ---- reading ----

    def steps(self) -> list[int]:
        """Steps with anything in the store, complete or not, oldest first."""
        fs = self.fs
        fs.invalidate_cache()
        try:
            entries = fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:  # noqa: BLE001
            raise CheckpointStoreError(f"cannot list the checkpoint store {self.describe()}: {exc}") from exc
        steps = []
        for path in entries:
            match = _STEP_DIR.match(path.rstrip("/").rsplit("/", 1)[-1])
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def complete_steps(self) -> list[int]:
        return [step for step in self.steps() if self.fs.exists(f"{self._step_dir(step)}/{MANIFEST}")]

    def manifest(self, step: int) -> RunManifest:
        path = f"{self._step_dir(step)}/{MANIFEST}"
        try:
            data = json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            raise CheckpointStoreError(f"{self.describe()} has no complete checkpoint at step {step}") from None
        except Exception as exc:  # noqa: BLE001
            raise CheckpointStoreError(f"cannot read {path}: {exc}") from exc
        try:
            if data["format"] != FORMAT or data["run_id"] != self.run_id or int(data["step"]) != step:
                raise ValueError(f"format {data.get('format')!r}, run {data.get('run_id')!r}, step {data.get('step')!r}")
            stages = tuple(StageEntry.from_json(s) for s in data["stages"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointStoreError(f"{path} is not a manifest of run {self.run_id} at step {step}: {exc}") from exc
        if [s.stage for s in stages] != list(range(self.num_stages)):
            raise CheckpointStoreError(f"{path} names stages {[s.stage for s in stages]}; this run has "
                                       f"{self.num_stages}")
        return RunManifest(run_id=self.run_id, step=step, stages=stages, written_at=float(data.get("written_at", 0)))

    def latest(self) -> Optional[RunManifest]:
        """The newest complete checkpoint, or None when the store holds none."""
        for step in reversed(self.complete_steps()):
            try:
                return self.manifest(step)
            except CheckpointStoreError as exc:
                logger.warning("skipping a damaged checkpoint: %s", exc)
        return None

    def read_range(self, manifest: RunManifest, stage: int, start: int, end: int) -> bytes:
        """Bytes [start, end) of one stage's object (one ranged GET on an object store)."""
        remote = f"{self._step_dir(manifest.step)}/{manifest.stages[stage].file}"
        try:
            return self.fs.cat_file(remote, start=start, end=end)
        except FileNotFoundError:
            raise CheckpointStoreError(f"{remote} is gone (deleted by retention meanwhile?)") from None
        except Exception as exc:  # noqa: BLE001
            raise CheckpointStoreError(f"cannot read {remote} [{start}, {end}): {exc}") from exc

    def fetch_stage(self, manifest: RunManifest, stage: int, workdir: Path) -> Path:
        """A local, verified copy of one stage's object (the object itself when the store is local)."""
        entry = manifest.stages[stage]
        remote = f"{self._step_dir(manifest.step)}/{entry.file}"
        if self.local:
            path = Path(remote)
        else:
            workdir.mkdir(parents=True, exist_ok=True)
            path = workdir / f"step{manifest.step}-{entry.file}"
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                self.fs.get_file(remote, str(tmp))
                os.replace(tmp, path)
            except Exception as exc:  # noqa: BLE001
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise CheckpointStoreError(f"cannot download {remote}: {exc}") from exc
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointStoreError(f"{remote} is gone (deleted by retention meanwhile?)") from None
        if size != entry.bytes or _sha256(path) != entry.sha256:
            raise CheckpointStoreError(f"{remote} does not match its manifest ({size} bytes, expected {entry.bytes}, "
                                       "or another SHA-256): damaged in the store")
        return path


def staging_dir() -> Path:
    """A private local directory for objects on their way to the store."""
    return Path(tempfile.mkdtemp(prefix="agora-checkpoint-"))


def write_staged(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Serialize a stage object locally (safetensors); the upload reads it from here."""
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path), metadata=metadata)
    return path
