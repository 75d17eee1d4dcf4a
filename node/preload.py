"""Importing what a role needs while the node waits on the network, not after.

A worker's first `torch.optim.AdamW` imports `torch._dynamo` (torch wraps the optimizer's methods
in a lazy `_disable_dynamo`), and the role's own modules pull in hivemind's averaging: together
2-7 s of CPU on a loaded 2-core machine, which a restarted worker used to spend between joining
the swarm and forking its averager, with nothing else to do (docs/performance.md, "Joining fast"). Admission
and the DHT bootstrap, before it, are mostly waiting on other processes. `Preload` runs the
imports in a thread during those waits.

hivemind forks the DHT process and the averager process, and a fork while another thread is
inside an import leaves the child with that module's import lock held by a thread that does not
exist there: the child hangs the first time it touches the module. So the thread stops between
two imports before every fork (`pause`), goes on after it (`forked`), and is finished before the
averager forks (`finish`). No thread of ours is running at a fork (docs/architecture.md,
'Processes and threads'). A fork waits for the import in progress, so the long imports are only
started after the DHT process forked: they overlap its bootstrap instead of delaying it.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import time
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

ROLE_MODULES = {
    # role: (imported while admission waits, imported once the DHT process forked)
    "worker": (("roles.worker.role",), ("torch._dynamo",)),
    "trainer": (("roles.trainer.role",), ()),
}
"""What each role imports on its way to serving; a role not listed preloads nothing."""


class Preload:
    """Imports `early` then `late` modules in order in a thread that can be stopped between two of
    them; `late` ones only after `forked`. A module that fails to import is skipped here: the
    role's own import raises the error where it belongs."""

    def __init__(self, early: Sequence[str] = (), late: Sequence[str] = ()):
        self.modules = [*early, *late]
        self._allowed = len(early)
        """How many of `modules` the thread may import so far."""
        self._next = 0
        self._pausing = False
        self._thread: Optional[threading.Thread] = None
        self._stopped: Optional[asyncio.Future] = None
        self.seconds = 0.0
        """Time spent importing, in the thread."""

    @classmethod
    def for_role(cls, role: str) -> "Preload":
        early, late = ROLE_MODULES.get(role, ((), ()))
        return cls(early, late)

    @property
    def done(self) -> bool:
        return self._next >= len(self.modules)

    def resume(self) -> None:
        """Start (or go on) importing in a thread. Call on the event loop."""
        self._pausing = False
        if self._next >= self._allowed or (self._thread is not None and self._thread.is_alive()):
            return
        loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(loop, self._stopped), name="preload", daemon=True)
        self._thread.start()

    async def pause(self) -> None:
        """Return once the thread is gone, after the import in progress (if any) ended; a fork is
        safe then."""
        self._pausing = True
        await self._join()

    def forked(self) -> None:
        """The DHT process forked: go on, with the long imports too."""
        self._allowed = len(self.modules)
        self.resume()

    async def finish(self) -> None:
        """Import the rest and return once everything is imported."""
        self._allowed = len(self.modules)
        self.resume()
        await self._join()
        if self.modules:
            logger.debug("preloaded %s in %.1fs", ", ".join(self.modules), self.seconds)

    async def _join(self) -> None:
        thread, stopped = self._thread, self._stopped
        if thread is None or stopped is None:
            return
        await asyncio.shield(stopped)
        thread.join()  # it only has to return from _run now: microseconds
        self._thread = None

    def _run(self, loop: asyncio.AbstractEventLoop, stopped: asyncio.Future) -> None:
        try:
            while not self._pausing and self._next < self._allowed:
                name = self.modules[self._next]
                began = time.perf_counter()
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - the role's own import reports it
                    logger.debug("preloading %s failed", name, exc_info=True)
                self.seconds += time.perf_counter() - began
                self._next += 1
        finally:
            try:
                loop.call_soon_threadsafe(_settle, stopped)
            except RuntimeError:  # the loop is gone: the node stopped meanwhile
                pass


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
