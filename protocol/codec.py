"""The one codec for everything on the wire: msgpack envelopes and the tensor encoding.

Tensors travel as ``{dtype, shape, data}`` maps, never pickled. Decoding treats its input as
hostile: every size is checked against the declared shape and dtype before a tensor is built,
and the number of elements is capped so a forged shape cannot make us allocate gigabytes.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import msgpack
import numpy as np
import torch

from protocol.errors import ErrorCode, ProtocolError

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
_ITEM_SIZES = {name: torch.empty((), dtype=dt).element_size() for name, dt in WIRE_DTYPES.items()}
MAX_TENSOR_ELEMENTS = 1 << 28
MAX_TENSOR_DIMS = 8


def pack(obj: Any) -> bytes:
    """Serialize a msgpack-able tree (dicts, lists, str, bytes, numbers, None)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, *, max_len: int = 1 << 30) -> Any:
    """Deserialize untrusted bytes; any failure becomes a typed ProtocolError."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_len,
            max_str_len=max_len,
            max_array_len=1 << 20,
            max_map_len=1 << 16,
        )
    except Exception as exc:  # msgpack raises a zoo of types for malformed input
        raise ProtocolError(f"undecodable msgpack: {exc}", ErrorCode.MALFORMED_FRAME) from exc


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """Turn a tensor into its wire map; the bytes are little-endian and C-contiguous."""
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise ProtocolError(f"dtype {tensor.dtype} cannot travel", ErrorCode.INVALID_TENSOR)
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        data = tensor.view(torch.int16).numpy().tobytes()
    else:
        data = tensor.numpy().tobytes()
    return {"dtype": name, "shape": list(tensor.shape), "data": data}


def decode_tensor(wire: Any) -> torch.Tensor:
    """Build a tensor from an untrusted wire map, checking dtype, shape and byte length."""
    if not isinstance(wire, dict):
        raise ProtocolError("tensor must be a map", ErrorCode.INVALID_TENSOR)
    name, shape, data = wire.get("dtype"), wire.get("shape"), wire.get("data")
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise ProtocolError(f"unsupported tensor dtype {name!r:.64}", ErrorCode.INVALID_TENSOR)
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > MAX_TENSOR_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d for d in shape)
    ):
        raise ProtocolError(f"invalid tensor shape {shape!r}", ErrorCode.INVALID_TENSOR)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("tensor data must be bytes", ErrorCode.INVALID_TENSOR)
    numel = math.prod(shape)
    if numel > MAX_TENSOR_ELEMENTS:
        raise ProtocolError(f"tensor of {numel} elements exceeds the limit", ErrorCode.INVALID_TENSOR)
    if len(data) != numel * _ITEM_SIZES[name]:
        raise ProtocolError(
            f"tensor data is {len(data)} bytes, shape {list(shape)} of {name} needs {numel * _ITEM_SIZES[name]}",
            ErrorCode.INVALID_TENSOR,
        )
    if numel == 0:
        return torch.empty(shape, dtype=WIRE_DTYPES[name])
    if name == "bfloat16":
        return _over(np.frombuffer(data, dtype="<i2").reshape(shape)).view(torch.bfloat16)
    return _over(np.frombuffer(data, dtype=_NUMPY_DTYPES[name]).reshape(shape))


_NUMPY_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "int64": np.dtype("<i8")}


def _over(array: np.ndarray) -> torch.Tensor:
    """A tensor over the frame's own bytes, not a copy (the copy was a third of decoding a 4 KB
    tensor, and grows with it). msgpack gives every binary field a bytes object of its own and
    nothing else holds it, so the memory is this tensor's alone: a caller that writes into a
    decoded tensor in place writes into that private buffer (decoding the same unpacked map
    twice would share it; nothing does)."""
    return torch.from_numpy(array)


# Torch warns (once) that it cannot mark a tensor over read-only memory read-only; see _over.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
