"""Process lifecycle: no child of ours outlives the node (hivemind's DHT process, p2pd), and no
shared-memory file either.

hivemind switches torch to the `file_system` sharing strategy, whose segments live as
/dev/shm/torch_<pid>_* files until every user is gone; a process that dies hard leaves them
behind, so whoever reaps a process also removes the segments it created.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Iterable

import psutil

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def descendant_pids(pid: int | None = None) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def reap_children(timeout_s: float = 5.0) -> None:
    """Terminate, then kill, every descendant process still alive, wait for them, and remove the
    shared-memory segments they created. Our own segments are freed by torch when we exit;
    unlinking them under it would make it abort."""
    try:
        children = [c for c in psutil.Process().children(recursive=True) if not _is_shm_manager(c)]
    except psutil.Error:
        children = []
    pids = [c.pid for c in children]
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
    remove_shared_memory(pids)


def _is_shm_manager(process: psutil.Process) -> bool:
    """torch's shared-memory manager must outlive our last shared tensor: killing it makes torch
    abort at exit ("Broken pipe"). It leaves by itself once its clients are gone."""
    try:
        return process.name() == "torch_shm_manager"
    except psutil.Error:
        return False


def shared_memory_files(pids: Iterable[int]) -> list[str]:
    files: list[str] = []
    for pid in set(pids):
        files.extend(glob.glob(os.path.join(SHM_DIR, f"torch_{pid}_*")))
    return files


def remove_shared_memory(pids: Iterable[int]) -> None:
    """Unlink the torch segments of `pids`; memory still mapped stays valid until unmapped."""
    for path in shared_memory_files(pids):
        try:
            os.unlink(path)
        except OSError:
            pass
