"""Finding the processes a test started, however deep, by a marker in their environment."""

from __future__ import annotations

import psutil


def processes_with_marker(marker: str) -> list[int]:
    """Live processes whose environment has AGORA_TEST_MARKER=`marker` (children inherit it)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("AGORA_TEST_MARKER") == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found
