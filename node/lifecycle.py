"""Process lifecycle: no child of ours outlives the node (hivemind's DHT process, p2pd)."""

from __future__ import annotations

import logging

import psutil

logger = logging.getLogger(__name__)


def reap_children(timeout_s: float = 5.0) -> None:
    """Terminate, then kill, every descendant process still alive, and wait for them."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    if not children:
        return
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)
    if alive:
        logger.warning("killed %d child process(es) that ignored SIGTERM", len(alive))
