"""Simulated spot preemption on an operator's order [report 3.5.3.1, failure injection].

`PreemptionWatcher` reads this worker's own order from the DHT (`{run}/control`, subkey
`preempt:<peer id>`, protocol/control_orders.py) every `poll_period_s`, verifies it against the
run's root key and arms `PreemptSwitch` with its moment. Orders issued before this process
started are ignored, so a node restarted with the same identity is not preempted again by the
order that killed it. In an open run the watcher never starts: any peer could write an order
there, and nobody may preempt anyone.

The switch lives in shared memory created before the averager process forks, so the moment is
detected where it happens and the node dies there:

- `now`: at once, from the watcher;
- `forward` / `backward`: in the compute thread, mid batch (the model has run, the replies have
  not gone back; StageRuntime.mid_compute);
- `chunk_send` / `reduced_send`: in the averager process, after the first part it sends to a
  reducer / after the first averaged part it sends back as a reducer (InstrumentedRunner). A worker
  that is not a reducer never sends averaged parts back, so `reduced_send` arms `chunk_send`
  there, with a warning.

Dying is one WARNING line (`preempted by operator order <id> at <moment>`), a flush of the log
handlers and SIGKILL to the node's main process; node/lifecycle.py's watchdog then reaps every
child and removes what they left, as for any spot preemption.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from typing import Optional

import psutil

from protocol.auth_state import SharedAuthState
from protocol.control_orders import OrderRefused, PreemptMoment, preempt_subkey, verify_order
from protocol.dht_schema import control_key
from roles.periodic import every

logger = logging.getLogger(__name__)

_CODES = {moment: index + 1 for index, moment in enumerate(PreemptMoment)}
_MOMENTS = {code: moment for moment, code in _CODES.items()}
_ORDER_ID_BYTES = 64


class PreemptSwitch:
    """The armed moment and order id, in shared memory: the node's threads and its averager
    process (forked after this is built) read the same values. Only the watcher writes them."""

    def __init__(self, node_pid: Optional[int] = None):
        context = multiprocessing.get_context("fork")
        self.node_pid = os.getpid() if node_pid is None else node_pid
        self._moment = context.Value("i", 0, lock=False)
        self._order_id = context.Array("c", _ORDER_ID_BYTES, lock=False)

    def arm(self, moment: PreemptMoment, order_id: str) -> None:
        self._order_id.value = order_id.encode()[:_ORDER_ID_BYTES - 1]
        self._moment.value = _CODES[moment]  # written last: a reader that sees the moment sees the id

    @property
    def armed(self) -> Optional[PreemptMoment]:
        return _MOMENTS.get(self._moment.value)

    def fire_if(self, moment: PreemptMoment) -> None:
        """Die now if the switch is armed for `moment` (cheap enough for every part and batch)."""
        if self._moment.value == _CODES[moment]:
            self.fire(moment)

    def on_compute(self, what: str) -> None:
        """StageRuntime.mid_compute: "forward" or "backward"."""
        self.fire_if(PreemptMoment(what))

    def fire(self, moment: PreemptMoment) -> None:
        logger.warning("preempted by operator order %s at %s", self._order_id.value.decode(errors="replace"),
                       moment.value)
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:  # a broken stream must not save the node from its preemption
                pass
        os.kill(self.node_pid, signal.SIGKILL)
        if os.getpid() != self.node_pid:
            # The averager process goes down with its node, as on a preempted machine: alive, it
            # would hold its all-reduce streams open and its peers would wait out their timeout
            # (seen in the lab: a preempted reducer stalled its stage's round for allreduce_timeout_s).
            os.kill(os.getpid(), signal.SIGKILL)


class PreemptionWatcher:
    """Polls this worker's preempt order and arms the switch (see module docstring)."""

    def __init__(self, swarm, *, run_id: str, auth_state: SharedAuthState, switch: PreemptSwitch, reducer: bool,
                 poll_period_s: float = 1.5):
        self.swarm = swarm
        self.run_id = run_id
        self.auth_state = auth_state
        self.switch = switch
        self.reducer = reducer
        self.poll_period_s = poll_period_s
        self.started_at = psutil.Process(switch.node_pid).create_time()
        """Orders issued before this are for an earlier process with this identity."""
        self.refused: dict[str, int] = {}
        """Orders for us that did not verify, by reason (the DHT's validators refuse them first)."""
        self._seen: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.poll_period_s, self.poll_once, stop, name="preempt orders")

    async def poll_once(self) -> None:
        subkey = preempt_subkey(self.swarm.peer_id)
        future = self.swarm.dht.get(control_key(self.run_id), latest=True, return_future=True)
        try:
            found = await asyncio.wait_for(asyncio.wrap_future(future), self.poll_period_s * 4 + 5)
        except asyncio.TimeoutError:
            future.cancel()
            return
        item = found.value.get(subkey) if found is not None and isinstance(found.value, dict) else None
        if item is not None:
            self.consider(item.value, item.expiration_time)

    def consider(self, value: object, expiration: Optional[float] = None) -> None:
        """Verify an order read from the DHT and arm the switch with it, once per order."""
        try:
            signed = verify_order(self.auth_state.root_public_key, value, run_id=self.run_id,
                                  subkey=preempt_subkey(self.swarm.peer_id), record_expiration=expiration)
        except OrderRefused as refused:
            self.refused[refused.reason.value] = self.refused.get(refused.reason.value, 0) + 1
            return
        order = signed.order
        if order.order_id in self._seen:
            return
        self._seen.add(order.order_id)
        if order.issued_at < self.started_at:
            logger.info("ignoring operator order %s (%s): issued before this process started", order.order_id,
                        order.moment.value)
            return
        moment = order.moment
        if moment is PreemptMoment.REDUCED_SEND and not self.reducer:
            logger.warning("operator order %s asks for a preemption while sending reduced parts, but this worker "
                           "is not a reducer; preempting while sending its own parts instead", order.order_id)
            moment = PreemptMoment.CHUNK_SEND
        if moment is PreemptMoment.NOW:
            self.switch.arm(moment, order.order_id)
            self.switch.fire(moment)
            return
        logger.info("operator order %s armed: this worker will be preempted at its next %s", order.order_id,
                    moment.value)
        self.switch.arm(moment, order.order_id)
