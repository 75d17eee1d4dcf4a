"""What this node holds in memory, for its announcement and its metrics: the process's resident
memory, the host's memory (or the cgroup's limit when the node runs in a smaller container), and
the accelerator's memory when the node computes on one.

Each reading is a system call or two; callers read it when they announce or are scraped, never
per request.
"""

from __future__ import annotations

import logging
from typing import Optional

logger = logging.getLogger(__name__)

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_rss_bytes() -> int:
    """Resident memory of this process alone (its forked children are counted by themselves)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def host_memory_total_bytes() -> int:
    """The host's RAM, or this process's cgroup memory limit when that is lower: what the node
    can really use before it is killed."""
    import psutil

    total = int(psutil.virtual_memory().total)
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))  # "max" (v2) or a huge number (v1) mean no limit
        break
    return total


def device_memory(device: str) -> tuple[Optional[int], Optional[int]]:
    """Bytes torch holds on `device` and the device's total, or (None, None) on the CPU."""
    if not device.startswith("cuda"):
        return None, None
    import torch

    if not torch.cuda.is_available():
        return None, None
    index = torch.device(device)
    used = int(torch.cuda.memory_allocated(index))
    _free, total = torch.cuda.mem_get_info(index)
    return used, int(total)
