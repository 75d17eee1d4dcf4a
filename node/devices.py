"""Choosing the compute device at start, and how much memory it has free."""

from __future__ import annotations

from typing import Optional

from protocol.errors import ConfigError


def pick_device(requested: str, *, planning: bool = False, dry_run: bool = False) -> str:
    """`auto` takes CUDA when present (or when planning for a card with --gpu-memory), else CPU.
    `cuda` on a machine without it is a config error, except for a --dry-run with --gpu-memory."""
    import torch

    present = torch.cuda.is_available()
    if requested == "auto":
        requested = "cuda" if present or planning else "cpu"
    if requested.startswith("cuda") and not present:
        if planning and dry_run:
            return requested
        if planning:
            raise ConfigError("--gpu-memory plans for a card that is not in this machine; add --dry-run to see the "
                              "plan, or run with --device cpu")
        raise ConfigError("--device cuda was requested but no CUDA device is visible; use --device cpu or auto "
                          "(or --gpu-memory SIZE --dry-run to plan for a card)")
    return requested


def device_free_bytes(device: str, planned: Optional[int] = None) -> Optional[int]:
    """Free accelerator memory (`planned` stands for the card when given), or None for the CPU
    (host RAM is then the only budget)."""
    if not device.startswith("cuda"):
        return None
    if planned is not None:
        return planned
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)
