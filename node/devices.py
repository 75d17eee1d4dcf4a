"""Choosing the compute device at start, and how much memory it has free."""

from __future__ import annotations

from typing import Optional

from protocol.errors import ConfigError


def pick_device(requested: str) -> str:
    """`auto` takes CUDA when present, else CPU; `cuda` on a machine without it is a config error."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA device is visible; use --device cpu or auto")
    return requested


def device_free_bytes(device: str) -> Optional[int]:
    """Free accelerator memory, or None for the CPU (host RAM is then the only budget)."""
    import torch

    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return None
