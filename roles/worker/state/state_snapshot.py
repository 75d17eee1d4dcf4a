"""A stage's state frozen as one canonical byte string, cut into chunks with a SHA-256 each:
what a donor serves and a joiner assembles in a multi-donor download.

The bytes are a pure function of the state (docs/architecture.md, "Multi-donor state download"):
an 8-byte little-endian header length, a JSON header with sorted keys (run, stage, step, layout
digest, the optimizer's scalars, and every tensor's name, dtype, shape and byte range), then the
tensors' little-endian bytes, each at an 8-byte aligned offset: the parameters in layout order,
then the optimizer's tensors by (parameter index, key). Nothing in it depends on the writer, the
time or a hash map's order (safetensors' metadata map is serialized in random order, so two
identical replicas would publish different bytes with it). Two donors holding bit-identical
state therefore publish the same manifest id, and a joiner may take chunks from both.

Only float, int and bool tensors on the CPU go in; a header over HEADER_MAX_BYTES or a tensor
range outside the blob is refused when thawing, so a blob assembled from a donor's chunks is
checked again before a tensor of it is used (the chunk hashes only prove it is the donor's).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from protocol.state_messages import SNAPSHOT_FORMAT, ManifestReply
from roles.checkpoint_store import StageState

HEADER_MAX_BYTES = 16 << 20
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                       torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


class SnapshotError(ValueError):
    """A blob that is not a stage snapshot this worker can use."""


@dataclass(frozen=True)
class Manifest:
    """What a donor publishes for one frozen snapshot (the wire form is ManifestReply)."""

    run_id: str
    stage: int
    step: int
    layout: str
    format: str
    total_bytes: int
    chunk_bytes: int
    chunks: tuple[bytes, ...]
    manifest_id: str

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    def to_reply(self) -> ManifestReply:
        return ManifestReply(run_id=self.run_id, stage=self.stage, step=self.step, layout=self.layout,
                             format=self.format, manifest_id=self.manifest_id, total_bytes=self.total_bytes,
                             chunk_bytes=self.chunk_bytes, chunks=list(self.chunks))

    @classmethod
    def from_reply(cls, reply: ManifestReply) -> Manifest:
        """The manifest a donor sent, refused unless its id is the hash of what it lists and the
        chunks cover `total_bytes` exactly."""
        if len(reply.chunks) != math.ceil(reply.total_bytes / reply.chunk_bytes):
            raise SnapshotError(f"{len(reply.chunks)} chunk hashes for {reply.total_bytes} bytes in chunks of "
                                f"{reply.chunk_bytes}")
        manifest = cls(run_id=reply.run_id, stage=reply.stage, step=reply.step, layout=reply.layout,
                       format=reply.format, total_bytes=reply.total_bytes, chunk_bytes=reply.chunk_bytes,
                       chunks=tuple(reply.chunks), manifest_id=reply.manifest_id)
        if manifest_id_of(manifest) != reply.manifest_id:
            raise SnapshotError("its manifest id is not the hash of the manifest")
        return manifest


def manifest_id_of(m: Manifest) -> str:
    digest = hashlib.sha256(json.dumps([m.format, m.run_id, m.stage, m.step, m.layout, m.total_bytes,
                                        m.chunk_bytes], separators=(",", ":")).encode())
    for chunk in m.chunks:
        digest.update(chunk)
    return digest.hexdigest()


def describe(blob: bytes | bytearray | memoryview, chunk_bytes: int, *, run_id: str, stage: int, step: int,
             layout: str) -> Manifest:
    """Cut `blob` into chunks and hash each (hashlib releases the GIL: call it off the event loop)."""
    view = memoryview(blob)
    chunks = tuple(hashlib.sha256(view[i:i + chunk_bytes]).digest() for i in range(0, len(view), chunk_bytes))
    partial = Manifest(run_id=run_id, stage=stage, step=step, layout=layout, format=SNAPSHOT_FORMAT,
                       total_bytes=len(view), chunk_bytes=chunk_bytes, chunks=chunks, manifest_id="")
    return Manifest(**{**partial.__dict__, "manifest_id": manifest_id_of(partial)})


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


def freeze(names: Sequence[str], params: Sequence[torch.Tensor], optimizer_state: Optional[dict[str, Any]], *,
           run_id: str, stage: int, step: int, layout: str) -> bytearray:
    """Serialize parameters and a StageOptimizer.state_dict() canonically. The tensors are read
    while this runs: the caller holds the optimizer's lock."""
    tensors: list[tuple[str, torch.Tensor]] = list(zip(names, params))
    optimizer: Optional[dict[str, Any]] = None
    if optimizer_state is not None:
        torch_state = optimizer_state["optimizer"]
        other: dict[str, dict[str, Any]] = {}
        for index in sorted(torch_state["state"]):
            values = torch_state["state"][index]
            for key in sorted(values):
                value = values[key]
                if isinstance(value, torch.Tensor):
                    tensors.append((f"optimizer.state.{index}.{key}", value))
                else:
                    other.setdefault(str(index), {})[key] = value
        for name in sorted(optimizer_state.get("outer") or {}):
            tensors.append((f"optimizer.outer.{name}", optimizer_state["outer"][name]))
        optimizer = {"version": optimizer_state["version"], "local_step": optimizer_state["local_step"],
                     "samples_consumed": optimizer_state["samples_consumed"],
                     "param_groups": torch_state["param_groups"], "other_state": other}
    entries, offset = [], 0
    for name, tensor in tensors:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise SnapshotError(f"{name} has dtype {dtype}, which a snapshot does not carry")
        size = tensor.numel() * tensor.element_size()
        entries.append([name, dtype, list(tensor.shape), offset, offset + size])
        offset = _align(offset + size)
    header = json.dumps({"format": SNAPSHOT_FORMAT, "run_id": run_id, "stage": stage, "step": step,
                         "layout": layout, "optimizer": optimizer, "tensors": entries},
                        sort_keys=True, separators=(",", ":")).encode()
    base = _align(8 + len(header))
    blob = bytearray(base + offset)
    blob[:8] = struct.pack("<Q", len(header))
    blob[8:8 + len(header)] = header
    for (_, tensor), (_, _, _, start, end) in zip(tensors, entries):
        if end > start:
            raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            blob[base + start:base + end] = memoryview(raw.numpy())
    return blob


def thaw(blob: bytes | bytearray, names: Sequence[str]) -> tuple[dict[str, Any], StageState]:
    """The header and the state of a snapshot; `names` are the parameters this stage expects."""
    if len(blob) < 8:
        raise SnapshotError("a snapshot shorter than its header length")
    (length,) = struct.unpack("<Q", bytes(blob[:8]))
    if length > HEADER_MAX_BYTES or 8 + length > len(blob):
        raise SnapshotError(f"a header of {length} bytes in a snapshot of {len(blob)}")
    try:
        header = json.loads(bytes(blob[8:8 + length]))
        entries = header["tensors"]
        base = _align(8 + length)
        tensors: dict[str, torch.Tensor] = {}
        for name, dtype, shape, start, end in entries:
            item = torch.empty((), dtype=_DTYPES[dtype]).element_size()
            if not (0 <= start <= end and base + end <= len(blob) and end - start == math.prod(shape) * item):
                raise SnapshotError(f"{name}: byte range [{start}, {end}) does not fit")
            data = torch.frombuffer(blob, dtype=_DTYPES[dtype], count=math.prod(shape), offset=base + start) \
                if end > start else torch.empty(0, dtype=_DTYPES[dtype])
            tensors[name] = data.reshape(shape).clone()
    except SnapshotError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SnapshotError(f"not a readable stage snapshot: {exc}") from exc
    if header.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotError(f"format {header.get('format')!r}, this node reads {SNAPSHOT_FORMAT}")
    missing = [name for name in names if name not in tensors]
    if missing:
        raise SnapshotError(f"the snapshot misses parameter(s) {missing[:3]}")
    optimizer = None
    info = header.get("optimizer")
    if info is not None:
        state: dict[int, dict[str, Any]] = {}
        for name, tensor in tensors.items():
            if name.startswith("optimizer.state."):
                index, key = name[len("optimizer.state."):].split(".", 1)
                state.setdefault(int(index), {})[key] = tensor
        for index, values in info.get("other_state", {}).items():
            state.setdefault(int(index), {}).update(values)
        optimizer = {"version": info["version"], "local_step": info["local_step"],
                     "samples_consumed": info["samples_consumed"],
                     "optimizer": {"state": state, "param_groups": info["param_groups"]},
                     "outer": {name[len("optimizer.outer."):]: tensor for name, tensor in sorted(tensors.items())
                               if name.startswith("optimizer.outer.")}}
    metadata = {"run_id": str(header.get("run_id")), "stage": str(header.get("stage")),
                "step": str(header.get("step")), "layout": str(header.get("layout"))}
    return header, StageState(parameters={name: tensors[name] for name in names}, optimizer=optimizer,
                              metadata=metadata)
