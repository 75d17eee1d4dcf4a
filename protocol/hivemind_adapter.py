"""The one module that touches hivemind's private API, so that a hivemind upgrade that moves it
breaks here, loudly, and nowhere else.

agora-node needs three things hivemind does not expose publicly:

- dial a peer at the addresses it announced (`P2P._client.connect`/`disconnect`): a first call
  must not depend on the DHT having introduced the two peers, and the authorizer's reachability
  check is exactly such a dial;
- set a round's group key and target group size inside the averager process
  (`DecentralizedAverager._matchmaking`, reached through its control pipe `_outer_pipe`), so
  replicas with other index sets never meet and a full group starts at once [report 3.3.1.8];
- see what an all-reduce round lost (`_aggregate_with_group` overridden; `AllReduceRunner`'s
  `_generate_input_for_peer` and `_accumulate_parts_streaming`; the part container's and the
  reducer's counters), because hivemind completes a round with zeros where a peer failed and
  tells nobody [report 5.7.1.1].

`AdaptedAverager` and `AdaptedRunner` expose those under public names with hooks; everything
else in the repository uses only them and hivemind's public API. `PRIVATE_API` lists every
private or undocumented name used here; `missing_private_api` checks the class-level ones,
`missing_attributes` the ones that exist only on live objects, and
`tests/unit/test_hivemind_adapter.py` exercises all of them on real objects.

hivemind's version is checked at import against `TESTED_VERSIONS`; outside that range the import
warns (`HivemindVersionWarning`) with the names that are gone, and a use of a missing name raises
`HivemindIncompatible` naming it, instead of an AttributeError deep in a round.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Optional, Sequence

import hivemind
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from hivemind.p2p import P2P, PeerID
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.multiaddr import Multiaddr

from protocol.errors import AgoraError

logger = logging.getLogger(__name__)

TESTED_VERSIONS = ("1.1.12", "1.1.12")
"""Lowest and highest hivemind release this module was tested with (inclusive)."""


class HivemindIncompatible(AgoraError):
    """The installed hivemind lacks a private name agora-node relies on."""


class HivemindVersionWarning(UserWarning):
    """The installed hivemind is outside the tested range."""


@dataclass(frozen=True)
class PrivateName:
    owner: str
    """The hivemind class (or, for instance attributes, whose instances) that holds it."""
    path: str
    """Dotted attribute path from the owner."""
    where: str
    """"class": checkable on the class; "instance": on a live object; "averager process": only
    inside the forked averager process."""
    use: str


PRIVATE_API: tuple[PrivateName, ...] = (
    PrivateName("P2P", "_client.connect", "instance", "dial a peer at announced addresses"),
    PrivateName("P2P", "_client.disconnect", "instance", "drop the reachability probe's connection"),
    PrivateName("DecentralizedAverager", "_outer_pipe", "instance", "send our calls to the averager process"),
    PrivateName("DecentralizedAverager", "lock_averaged_tensors", "instance",
                "lock the round buffer with a timeout (get_tensors has none)"),
    PrivateName("DecentralizedAverager", "_aggregate_with_group", "class", "overridden: instrumented all-reduce"),
    PrivateName("DecentralizedAverager", "_matchmaking.group_key_manager.group_bits", "averager process",
                "the round's group key"),
    PrivateName("DecentralizedAverager", "_matchmaking.target_group_size", "averager process",
                "start the all-reduce once the stage's workers are in"),
    PrivateName("DecentralizedAverager", "_matchmaking.potential_leaders.target_group_size", "averager process",
                "the same, for the leader election"),
    PrivateName("DecentralizedAverager", "_p2p", "averager process", "the runner's P2P"),
    PrivateName("DecentralizedAverager", "_running_groups", "averager process", "register the runner for its group"),
    PrivateName("DecentralizedAverager", "_averaging_alpha", "averager process", "apply the averaged delta"),
    PrivateName("DecentralizedAverager", "serializer", "averager process", "decode the gathered metadata"),
    PrivateName("DecentralizedAverager", "total_size", "averager process", "load balancing"),
    PrivateName("AllReduceRunner", "_generate_input_for_peer", "class", "overridden: a hook per part sent"),
    PrivateName("AllReduceRunner", "_accumulate_parts_streaming", "class", "overridden: a hook per part reduced"),
    PrivateName("AllReduceRunner", "tensor_part_container", "instance", "slices per peer, failed reducers"),
    PrivateName("AllReduceRunner", "tensor_part_reducer", "instance", "what each sender delivered"),
    PrivateName("AllReduceRunner", "sender_peer_ids", "instance", "senders, in reducer order"),
    PrivateName("AllReduceRunner", "banned_senders", "instance", "senders banned mid-round"),
    PrivateName("AllReduceRunner", "ordered_peer_ids", "instance", "the group, in slice order"),
    PrivateName("AllReduceRunner", "modes", "instance", "node or client, per peer"),
    PrivateName("TensorPartContainer", "_input_parts_by_peer", "instance", "slice size per reducer"),
    PrivateName("TensorPartContainer", "register_failed_reducer", "class", "wrapped: count fallen-back values"),
    PrivateName("TensorPartContainer", "failed_size", "instance", "values that fell back"),
    PrivateName("TensorPartReducer", "part_shapes", "instance", "values per part"),
    PrivateName("TensorPartReducer", "num_parts_received", "instance", "parts each sender delivered"),
    PrivateName("TensorPartReducer", "sender_failed_after", "instance", "where a banned sender stopped counting"),
)

_CLASSES = {"P2P": P2P, "DecentralizedAverager": DecentralizedAverager, "AllReduceRunner": AllReduceRunner,
            "TensorPartContainer": TensorPartContainer, "TensorPartReducer": TensorPartReducer}

# Parameters our overrides receive and pass on: a rename would silently bypass them.
_SIGNATURES = {
    ("DecentralizedAverager", "_aggregate_with_group"): ("self", "group_info", "min_vector_size", "kwargs"),
    ("AllReduceRunner", "_generate_input_for_peer"): ("self", "peer_index"),
    ("AllReduceRunner", "_accumulate_parts_streaming"): ("self", "stream", "sender_index"),
    ("TensorPartContainer", "register_failed_reducer"): ("self", "peer_index"),
}


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def version_problem(version: str = hivemind.__version__) -> Optional[str]:
    """A sentence saying the installed hivemind is untested, or None when it is in range."""
    low, high = TESTED_VERSIONS
    if _version_tuple(low) <= _version_tuple(version) <= _version_tuple(high):
        return None
    tested = low if low == high else f"{low} to {high}"
    return (f"hivemind {version} is installed, but agora-node was tested with hivemind {tested}; "
            f"its private API may have moved (see protocol/hivemind_adapter.py): install hivemind=={high}")


def _resolve(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing_private_api() -> list[str]:
    """Class-level private names that are gone or whose signature changed, as "Owner.name: why"."""
    problems = []
    for name in PRIVATE_API:
        if name.where != "class":
            continue
        owner = _CLASSES[name.owner]
        try:
            attribute = _resolve(owner, name.path)
        except AttributeError:
            problems.append(f"{name.owner}.{name.path}: missing")
            continue
        expected = _SIGNATURES.get((name.owner, name.path))
        if expected is not None and tuple(inspect.signature(attribute).parameters) != expected:
            problems.append(f"{name.owner}.{name.path}: signature is {inspect.signature(attribute)}, "
                            f"expected ({', '.join(expected)})")
    return problems


def missing_attributes(obj: Any, owner: str, where: str = "instance") -> list[str]:
    """The private names of `owner` (a key of PRIVATE_API's owners) that the live `obj` lacks."""
    missing = []
    for name in PRIVATE_API:
        if name.owner == owner and name.where == where:
            try:
                _resolve(obj, name.path)
            except AttributeError:
                missing.append(f"{owner}.{name.path}")
    return missing


def _private(obj: Any, path: str, owner: str) -> Any:
    try:
        return _resolve(obj, path)
    except AttributeError as exc:
        raise HivemindIncompatible(
            f"hivemind {hivemind.__version__} has no {owner}.{path}, which agora-node relies on "
            f"(tested with hivemind {TESTED_VERSIONS[1]}); install hivemind=={TESTED_VERSIONS[1]}") from exc


def _check_at_import() -> None:
    problem = version_problem()
    if problem is None:
        return
    gone = missing_private_api()
    if gone:
        problem += "; missing or changed: " + "; ".join(gone)
    warnings.warn(problem, HivemindVersionWarning, stacklevel=3)


_check_at_import()


# ---- P2P ----

async def connect(p2p: P2P, peer_id: PeerID, addresses: Sequence[str | Multiaddr]) -> None:
    """Open a libp2p connection to `peer_id` at transport `addresses` (without /p2p/...)."""
    client = _private(p2p, "_client", "P2P")
    await client.connect(peer_id, [a if isinstance(a, Multiaddr) else Multiaddr(a) for a in addresses])


async def disconnect(p2p: P2P, peer_id: PeerID) -> None:
    await _private(p2p, "_client", "P2P").disconnect(peer_id)


# ---- averaging ----

class AdaptedRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce with hooks and read-only views of what it lost.

    Subclasses override `after_part_sent`, `after_part_reduced` (awaited once per part, in the
    averager process) and `on_reducer_failed` (values of a reducer's slice that fell back to
    local values)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        container = _private(self, "tensor_part_container", "AllReduceRunner")
        original = _private(container, "register_failed_reducer", "TensorPartContainer")

        def register_failed_reducer(peer_index: int) -> None:
            before = container.failed_size
            original(peer_index)
            self.on_reducer_failed(peer_index, container.failed_size - before)

        container.register_failed_reducer = register_failed_reducer

    # hooks

    async def after_part_sent(self) -> None:
        """Called after each part this peer sent to a reducer."""

    async def after_part_reduced(self) -> None:
        """Called after each averaged part this peer, as a reducer, sent back."""

    def on_reducer_failed(self, peer_index: int, values: int) -> None:
        """A reducer failed: `values` of its slice keep this peer's local values."""

    # views

    @property
    def peers(self) -> list[str]:
        """The group in slice order, as base58 peer ids."""
        return [peer.to_base58() for peer in self.ordered_peer_ids]

    @property
    def index(self) -> int:
        """This peer's position in the group."""
        return list(self.ordered_peer_ids).index(self.peer_id)

    def mode_names(self) -> list[str]:
        return [AveragingMode(mode).name.lower() for mode in self.modes]

    def slice_sizes(self) -> list[int]:
        """Values each peer reduces: the run of parts assigned to it, in group order (hivemind's
        TensorPartContainer splits the flat buffer in that order)."""
        parts_by_peer = _private(self.tensor_part_container, "_input_parts_by_peer", "TensorPartContainer")
        return [sum(int(part.numel()) for part, _ in parts) for parts in parts_by_peer]

    def values_received(self) -> dict[str, int]:
        """As a reducer: how many values of this peer's slice each sender delivered before it
        finished or was banned."""
        reducer = self.tensor_part_reducer
        cumulative = [0]
        for shape in reducer.part_shapes:
            cumulative.append(cumulative[-1] + math.prod(shape))
        received = {}
        for index, sender in enumerate(self.sender_peer_ids):
            parts = reducer.num_parts_received[index]
            failed_after = reducer.sender_failed_after[index]
            if failed_after != float("inf"):
                parts = min(parts, int(failed_after))
            received[sender.to_base58()] = cumulative[min(parts, len(reducer.part_shapes))]
        return received

    def banned(self) -> list[str]:
        return sorted(peer.to_base58() for peer in self.banned_senders)

    # overrides of hivemind's private methods

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[Any]:
        async for message in super()._generate_input_for_peer(peer_index):
            yield message
            await self.after_part_sent()

    async def _accumulate_parts_streaming(self, stream, sender_index: int) -> AsyncIterator[Any]:
        async for message in super()._accumulate_parts_streaming(stream, sender_index):
            yield message
            await self.after_part_reduced()


class AdaptedAverager(DecentralizedAverager):
    """A DecentralizedAverager whose rounds can be keyed and sized per round and instrumented.

    Subclasses override `make_runner` (build the round's runner, an AdaptedRunner) and
    `round_result` (what `step` returns); both run in the averager process."""

    # host side

    def set_round_group(self, group_bits: str, target_group_size: Optional[int]) -> MPFuture:
        """Set the next round's group key bits and the group size at which a leader starts.
        Returns the confirmation without waiting: the averager handles its pipe in order, so a
        step sent after this runs with the new key."""
        future = MPFuture()
        pipe = _private(self, "_outer_pipe", "DecentralizedAverager")
        pipe.send(("_agora_set_round_group", [], dict(group_bits=group_bits, size=target_group_size, future=future)))
        return future

    @contextlib.contextmanager
    def tensors_locked(self, timeout_s: float) -> Iterator[bool]:
        """Hold the lock the averager process takes for a whole all-reduce; yields False (and
        holds nothing) if it was not free within `timeout_s`."""
        lock = _private(self, "lock_averaged_tensors", "DecentralizedAverager")
        acquired = lock.acquire(timeout=timeout_s)
        try:
            yield acquired
        finally:
            if acquired:
                lock.release()

    def probe_private_api(self) -> MPFuture:
        """Ask the averager process which of the private names it relies on it lacks (a list)."""
        future = MPFuture()
        pipe = _private(self, "_outer_pipe", "DecentralizedAverager")
        pipe.send(("_agora_probe", [], dict(future=future)))
        return future

    # averager process

    def make_runner(self, gathered: dict[str, Any], **runner_kwargs) -> AllReduceRunner:
        """The round's runner; `gathered` is each peer's gather data by base58 peer id."""
        return AdaptedRunner(**runner_kwargs)

    def round_result(self, gathered: dict[str, Any], runner: AllReduceRunner) -> Any:
        return gathered

    async def _agora_set_round_group(self, group_bits: str, size: Optional[int], future: MPFuture) -> None:
        try:
            matchmaking = _private(self, "_matchmaking", "DecentralizedAverager")
            matchmaking.group_key_manager.group_bits = group_bits
            matchmaking.target_group_size = size
            matchmaking.potential_leaders.target_group_size = size
            future.set_result(None)
        except Exception as exc:  # noqa: BLE001 - reported to the host process
            future.set_exception(exc)

    async def _agora_probe(self, future: MPFuture) -> None:
        future.set_result(missing_attributes(self, "DecentralizedAverager", "averager process"))

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs) -> Any:
        """hivemind's own (1.1.12), except that the runner comes from `make_runner` and the
        result from `round_result`. Peers in AUX mode are not supported (we never use it)."""
        try:
            bandwidths, mode_ids, user_gathered_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            gathered = {peer.to_base58(): self.serializer.loads(data)
                        for peer, data in zip(group_info.peer_ids, user_gathered_bytes)}
            modes = [AveragingMode(mode) for mode in mode_ids]
            download_bandwidths = [thr if mode != AveragingMode.CLIENT else 0.0 for thr, mode in zip(bandwidths, modes)]
            peer_fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, self.total_size, download_bandwidths, min_vector_size
            )
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                runner = self.make_runner(
                    gathered, p2p=_private(self, "_p2p", "DecentralizedAverager"), servicer_type=type(self),
                    prefix=self.prefix, tensors=local_tensors, group_id=group_info.group_id,
                    ordered_peer_ids=group_info.peer_ids, peer_fractions=peer_fractions, **kwargs)
                _private(self, "_running_groups", "DecentralizedAverager")[group_info.group_id].set_result(runner)
                alpha = _private(self, "_averaging_alpha", "DecentralizedAverager")
                index = 0
                async for update in runner:
                    local_tensors[index].add_(update, alpha=alpha)
                    index += 1
            return self.round_result(gathered, runner)
        except BaseException as exc:
            if isinstance(exc, Exception):
                logger.debug("all-reduce failed", exc_info=True)
            raise MatchmakingException(f"Unable to run All-Reduce: {exc}") from exc
