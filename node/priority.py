"""The CPU priority a node serves at, once it has started (`--serve-nice`, off by default).

A contributor's desktop should come first: once a worker or trainer serves it can lower its own
priority, as volunteer-computing clients do. It also decides who gets the CPU when several nodes
share a host: a node that starts runs at the priority it was given, the serving ones below it.

Measured on two cores with 3 x 2 workers and 2 trainers, one worker restarted every 30 s
(scripts/bench_join.py, one run each): restart-to-serving fell from 39.8 s (median) to 16.0 s with
the session's nice at 5 and 13.9 s with both knobs at 10, but the swarm completed 29% and 64% fewer
samples in the same time; without churn, 9% and 32% fewer. The loss comes from the session's
(autogroup) nice: the process group's nice alone cost 8%, within the noise. Why lowering every
node's session alike costs throughput we have not pinned down (the shares between them do not
change; coarser slices for the pipeline's many short hops are the likely cause). So it is off
unless asked for. On a desktop, one node per machine, `--serve-nice 10` should cost nothing while
the owner is not using it (not measured: every swarm here shares one host).

Two knobs, because either can be the one in force:
- the nice value of every thread of the node's process group (the node, its DHT and averager
  processes, its libp2p daemons): what counts between processes of one session, or on a kernel
  without autogroup;
- the session's autogroup nice, what counts between sessions, set only when the node leads its
  own session (systemd, a supervisor): from a terminal the session is the user's shell's.

A value is only ever raised (lower priority): a node started with `nice -n 15` stays at 15.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

logger = logging.getLogger(__name__)

AUTOGROUP = "/proc/self/autogroup"


def lower_priority(nice: int) -> Optional[str]:
    """Lower the node's CPU priority to `nice` (0 = leave it), if it is not lower already; what was
    changed, in words, or None. Never raises: a host that refuses keeps the node as it was."""
    if nice <= 0:
        return None
    changed = []
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        if current < nice:
            os.setpriority(os.PRIO_PGRP, 0, nice)  # every thread of every process in the group
            changed.append(f"nice {current} -> {nice}")
    except OSError as exc:
        logger.debug("could not lower the process group's priority: %s", exc)
    if os.getsid(0) == os.getpid():
        group = _set_autogroup_nice(nice)
        if group is not None:
            changed.append(group)
    return ", ".join(changed) or None


def _set_autogroup_nice(nice: int) -> Optional[str]:
    try:
        with open(AUTOGROUP) as f:
            current = int(f.read().split()[-1])  # "/autogroup-123 nice 0"
    except (OSError, ValueError, IndexError):
        return None  # a kernel without autogroup
    if current >= nice:
        return None
    for _ in range(5):  # the kernel takes one unprivileged write per 0.1 s on the whole host
        try:
            with open(AUTOGROUP, "w") as f:
                f.write(str(nice))
            return f"session nice {current} -> {nice}"
        except BlockingIOError:
            time.sleep(0.12)
        except OSError as exc:
            logger.debug("could not lower the session's priority: %s", exc)
            return None
    return None
