"""The one module that touches hivemind's private API, so that a hivemind upgrade that moves it
breaks here, loudly, and nowhere else.

agora-node needs seven things hivemind does not expose publicly:

- dial a peer at the addresses it announced (`P2P._client.connect`/`disconnect`): a first call
  must not depend on the DHT having introduced the two peers, and the authorizer's reachability
  check is exactly such a dial; a server drops the connection of a peer it shuns for flooding
  streams (protocol/stream_gate.py). A relayed address (`.../p2p/<relay>/p2p-circuit`) is encoded here:
  hivemind's multiaddr codec writes a `/p2p/` component as a CID, which p2pd cannot parse;
- pass p2pd flags hivemind's `P2P.create` has no parameter for (`P2P._make_process_args`): the
  run's relays serve with their own limits, contributors serve as nobody's relay, and a node behind
  NAT reserves slots on the run's relays only (node/reachability.py);
- set a round's group key and target group size inside the averager process
  (`DecentralizedAverager._matchmaking`, reached through its control pipe `_outer_pipe`), so
  replicas with other index sets never meet and a full group starts at once [report 3.3.1.8];
- see what an all-reduce round lost (`_aggregate_with_group` overridden; `AllReduceRunner`'s
  `_generate_input_for_peer` and `_accumulate_parts_streaming`; the part container's and the
  reducer's counters), because hivemind completes a round with zeros where a peer failed and
  tells nobody [report 5.7.1.1];
- admit a peer to the averager's RPCs (`rpc_join_group`, `rpc_aggregate_part`,
  `rpc_download_state`) only after our own check: `add_p2p_handlers` is overridden to register a
  wrapper, the servicer hook hivemind's own `utils/auth.py` uses, so the check runs before
  hivemind reads the request, and `_aggregate_with_group` checks the whole group before the
  all-reduce starts;
- screen each averaged part before it enters the average: `HoldingReducer` replaces the runner's
  `TensorPartReducer`, which adds each part to the sum as it arrives, with one that holds a part
  index's parts until every current sender's is in, so a part can be compared with the others
  and left out;
- seal every part a peer sends and check the seal of every part it reduces (the two ends of the
  part stream, overridden), so a refused part is evidence (protocol/part_evidence.py): the seal
  rides in each `AveragingData` message's `peer_id` bytes, which hivemind sets on no part message
  and reads on none.

`AdaptedAverager`, `AdaptedRunner` and `HoldingReducer` expose those under public names with
hooks; everything
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
import collections
import contextlib
import inspect
import logging
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, NamedTuple, Optional, Sequence

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import (
    AllreduceException, BannedException, TensorPartContainer, TensorPartReducer,
)
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.multiaddr import Multiaddr

from protocol.errors import AgoraError
from protocol.part_evidence import PartProof, PartSigning, encoding_refusal, seal_refusal

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
    PrivateName("P2P", "_make_process_args", "class", "wrapped: p2pd flags P2P.create does not take"),
    PrivateName("P2P", "_client.connect", "instance", "dial a peer at announced addresses"),
    PrivateName("P2P", "_client.disconnect", "instance",
                "drop the reachability probe's connection, and a shunned stream flooder's"),
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
    PrivateName("DecentralizedAverager", "_matchmaking.potential_leaders.min_matchmaking_time", "averager process",
                "a late leader's window ends with its followers'"),
    PrivateName("DecentralizedAverager", "_p2p", "averager process", "the runner's P2P"),
    PrivateName("DecentralizedAverager", "client_mode", "instance", "promote a sender to a reducer"),
    PrivateName("DecentralizedAverager", "mode", "instance", "promote a sender to a reducer (the gathered mode)"),
    PrivateName("DecentralizedAverager", "_matchmaking.client_mode", "averager process",
                "promote a sender to a reducer: it may lead groups and take join requests"),
    PrivateName("DecentralizedAverager", "_running_groups", "averager process", "register the runner for its group"),
    PrivateName("DecentralizedAverager", "_averaging_alpha", "averager process", "apply the averaged delta"),
    PrivateName("DecentralizedAverager", "serializer", "averager process", "decode the gathered metadata"),
    PrivateName("DecentralizedAverager", "total_size", "averager process", "load balancing"),
    PrivateName("AllReduceRunner", "_generate_input_for_peer", "class",
                "overridden: a hook per part sent; each part's seal in its message's unread peer_id bytes"),
    PrivateName("AllReduceRunner", "_accumulate_parts_streaming", "class",
                "overridden: a hook per part reduced; each part's seal checked as it is read"),
    PrivateName("AllReduceRunner", "group_id", "instance", "bound into each part's seal"),
    PrivateName("AllReduceRunner", "weight", "instance", "this peer's weight, in its own part's seal"),
    PrivateName("AllReduceRunner", "should_delay_results", "class",
                "overridden: a client-mode sender reads results while it sends (a dead reducer fails fast)"),
    PrivateName("AllReduceRunner", "reducer_timeout", "instance",
                "off for a client-mode sender, whose first result waits for its own upload"),
    PrivateName("AllReduceRunner", "tensor_part_container", "instance", "slices per peer, failed reducers"),
    PrivateName("AllReduceRunner", "tensor_part_reducer", "instance",
                "what each sender delivered; replaced by a HoldingReducer before the round starts"),
    PrivateName("AllReduceRunner", "sender_peer_ids", "instance", "senders, in reducer order"),
    PrivateName("AllReduceRunner", "banned_senders", "instance", "senders banned mid-round"),
    PrivateName("AllReduceRunner", "ordered_peer_ids", "instance", "the group, in slice order"),
    PrivateName("AllReduceRunner", "modes", "instance", "node or client, per peer"),
    PrivateName("TensorPartContainer", "_input_parts_by_peer", "instance", "slice size per reducer"),
    PrivateName("TensorPartContainer", "register_failed_reducer", "class", "wrapped: count fallen-back values"),
    PrivateName("TensorPartContainer", "failed_size", "instance", "values that fell back"),
    PrivateName("TensorPartReducer", "part_shapes", "instance", "values per part"),
    PrivateName("TensorPartReducer", "num_parts", "instance", "parts of the slice: a seal is kept for those only"),
    PrivateName("TensorPartReducer", "num_parts_received", "instance", "parts each sender delivered"),
    PrivateName("TensorPartReducer", "sender_failed_after", "instance", "where a banned sender stopped counting"),
    PrivateName("DecentralizedAverager", "add_p2p_handlers", "class",
                "overridden: register the admission wrapper instead of the averager itself"),
    PrivateName("DecentralizedAverager", "rpc_join_group", "class", "wrapped: admitted peers only"),
    PrivateName("DecentralizedAverager", "rpc_aggregate_part", "class", "wrapped: admitted peers only"),
    PrivateName("DecentralizedAverager", "rpc_download_state", "class", "wrapped: admitted peers only"),
    PrivateName("TensorPartReducer", "accumulate_part", "class", "overridden: hold a part, do not add it yet"),
    PrivateName("TensorPartReducer", "check_current_part_finished", "class",
                "overridden: screen the held parts, then average the accepted ones"),
    PrivateName("TensorPartReducer", "on_sender_failed", "class",
                "overridden: a sender the screen excluded is not excluded twice"),
    PrivateName("TensorPartReducer", "reset_accumulators", "class", "overridden: drop the held parts too"),
    PrivateName("TensorPartReducer", "num_senders", "instance", "senders of the round"),
    PrivateName("TensorPartReducer", "current_part_index", "instance", "the part being averaged"),
    PrivateName("TensorPartReducer", "current_part_accumulated_from", "instance", "senders in for that part"),
    PrivateName("TensorPartReducer", "current_part_future", "instance", "the part's average, awaited by senders"),
    PrivateName("TensorPartReducer", "num_current_senders", "instance", "senders still counted for that part"),
    PrivateName("TensorPartReducer", "accumulator", "instance", "the part's weighted sum"),
    PrivateName("TensorPartReducer", "denominator", "instance", "the part's total weight"),
    PrivateName("TensorPartReducer", "finished", "instance", "set once the reducer is done"),
)

_CLASSES = {"P2P": P2P, "DecentralizedAverager": DecentralizedAverager, "AllReduceRunner": AllReduceRunner,
            "TensorPartContainer": TensorPartContainer, "TensorPartReducer": TensorPartReducer}

# Parameters our overrides receive and pass on: a rename would silently bypass them.
_SIGNATURES = {
    ("DecentralizedAverager", "_aggregate_with_group"): ("self", "group_info", "min_vector_size", "kwargs"),
    ("AllReduceRunner", "_generate_input_for_peer"): ("self", "peer_index"),
    ("AllReduceRunner", "_accumulate_parts_streaming"): ("self", "stream", "sender_index"),
    ("TensorPartContainer", "register_failed_reducer"): ("self", "peer_index"),
    ("DecentralizedAverager", "add_p2p_handlers"): ("self", "p2p", "wrapper", "namespace", "balanced"),
    ("DecentralizedAverager", "rpc_join_group"): ("self", "request", "context"),
    ("DecentralizedAverager", "rpc_aggregate_part"): ("self", "stream", "context"),
    ("DecentralizedAverager", "rpc_download_state"): ("self", "_request", "_context"),
    ("TensorPartReducer", "accumulate_part"): ("self", "sender_index", "part_index", "tensor_part", "weight"),
    ("TensorPartReducer", "check_current_part_finished"): ("self",),
    ("TensorPartReducer", "on_sender_failed"): ("self", "sender_index"),
    ("TensorPartReducer", "reset_accumulators"): ("self",),
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
    unchecked = rpc_names(DecentralizedAverager) - set(ADMITTED_RPCS)
    if unchecked:
        problems.append(f"DecentralizedAverager: RPC(s) {', '.join(sorted(unchecked))} would be served without "
                        f"the admission check")
    return problems


ADMITTED_RPCS = ("rpc_join_group", "rpc_aggregate_part", "rpc_download_state")
"""The averager's RPCs the admission wrapper covers: every one hivemind 1.1.12 serves."""


def rpc_names(servicer: type) -> set[str]:
    """The RPCs a hivemind servicer class registers (as ServicerBase collects them)."""
    return {name for name, _ in inspect.getmembers(servicer, predicate=inspect.isfunction) if name.startswith("rpc_")}


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

def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


_P2P_CODE = 421


def wire_multiaddr(text: str) -> Multiaddr:
    """`text` as the Multiaddr p2pd parses. hivemind 1.1.12 writes a `/p2p/<id>` component as a
    CIDv1 (0x01 0x72 ...), p2pd expects the bare multihash and answers "length greater than
    remaining number of bytes in buffer"; a relayed address has such a component in its middle."""
    parts = text.strip("/").split("/")
    if "p2p" not in parts and "ipfs" not in parts:
        return Multiaddr(text)
    out, pending, index = b"", [], 0

    def flush() -> bytes:
        encoded = Multiaddr("/" + "/".join(pending)).to_bytes() if pending else b""
        pending.clear()
        return encoded

    import base58

    while index < len(parts):
        name = parts[index]
        if name in ("p2p", "ipfs") and index + 1 < len(parts):
            out += flush()
            digest = base58.b58decode(parts[index + 1])
            out += _varint(_P2P_CODE) + _varint(len(digest)) + digest
            index += 2
        elif name == "p2p-circuit":
            pending.append(name)
            index += 1
        else:
            pending.extend(parts[index:index + 2])
            index += 2
    out += flush()
    return Multiaddr(out)


async def connect(p2p: P2P, peer_id: PeerID, addresses: Sequence[str | Multiaddr]) -> None:
    """Open a libp2p connection to `peer_id` at transport `addresses` (without the trailing
    /p2p/<peer_id>; a relayed address keeps its relay's /p2p/<relay>/p2p-circuit)."""
    client = _private(p2p, "_client", "P2P")
    await client.connect(peer_id, [a if isinstance(a, Multiaddr) else wire_multiaddr(a) for a in addresses])


_daemon_flags: dict[str, Any] = {}


def set_daemon_flags(**flags: Any) -> None:
    """Extra p2pd flags for every P2P this process (and a child forked after this call, such as
    hivemind's DHT process) starts from now on, e.g. `relayService=False`; None removes one.
    One node per process, so one set of flags per process."""
    _private(P2P, "_make_process_args", "P2P")
    for name, value in flags.items():
        if value is None:
            _daemon_flags.pop(name, None)
        else:
            _daemon_flags[name] = value


def daemon_flags() -> dict[str, Any]:
    return dict(_daemon_flags)


async def create_plain_p2p(**kwargs: Any) -> P2P:
    """A P2P started without the flags set for this process's own node (a throwaway probe must not
    reserve relay slots or pose as private): they are set aside until its daemon has started. No
    other task of the process may start a daemon meanwhile."""
    saved = dict(_daemon_flags)
    _daemon_flags.clear()
    try:
        return await P2P.create(**kwargs)
    finally:
        _daemon_flags.clear()
        _daemon_flags.update(saved)


def _install_flag_hook() -> None:
    original = getattr(P2P, "_make_process_args", None)
    if original is None or getattr(original, "_agora_hook", False):
        return

    def make_process_args(*args, **kwargs):
        return original(*args, **{**kwargs, **_daemon_flags})

    make_process_args._agora_hook = True  # type: ignore[attr-defined]
    P2P._make_process_args = staticmethod(make_process_args)


_install_flag_hook()


async def disconnect(p2p: P2P, peer_id: PeerID) -> None:
    """Close every libp2p connection to `peer_id` (its streams go with them)."""
    await _private(p2p, "_client", "P2P").disconnect(peer_id)


# ---- averaging: parts held until every sender's is in ----

class HeldPart(NamedTuple):
    """One sender's part of the part index being averaged, as it arrived."""

    sender: int
    """The sender's index in the runner's `sender_peer_ids`."""
    tensor: torch.Tensor
    weight: float
    """The weight the sender chose for it (`AveragingData.weight`)."""
    proof: Optional[PartProof] = None
    """What the sender signed for it, as it arrived (None: its own part, or a sender that does not sign)."""


Screen = Callable[[int, Sequence[HeldPart]], dict[int, str]]
"""(part index, held parts) -> {sender index: why its part is rejected}."""
Screened = Callable[[int, Sequence[HeldPart], dict[int, str]], None]
"""(part index, every held part, {sender index: why rejected}), once a part index is decided."""


class HoldingReducer(TensorPartReducer):
    """hivemind's TensorPartReducer (1.1.12), except that a part index's parts are held until every
    current sender's has arrived, screened, and only then averaged.

    hivemind adds each part to the sum as it arrives, so a part cannot be compared with the others
    and a sender that sends garbage is in the average before anyone looks. Here `screen` sees all
    the held parts of one index at once and names the senders to leave out. A part whose shape is
    not the part's is rejected before `screen` sees it: hivemind would add a 1-element tensor to
    the whole accumulator by broadcasting. A rejected sender is out from that part on, as a sender
    hivemind bans (`sender_failed_after`); its pending `accumulate_part` raises BannedException,
    so hivemind's runner ends its stream and bans it, and `on_sender_failed` then leaves the
    counts alone (the sender is out already; hivemind's own would count it out a second time).

    The accepted parts are summed into hivemind's accumulator in arrival order with their weights
    and divided by the sum of the weights: with nothing rejected, the average is bit for bit the
    one hivemind's reducer returns. Holding costs no memory: hivemind keeps each received part
    alive until the average comes back anyway, to send the sender its difference. A sealed part's
    proof (its bytes as they arrived, for evidence) is held beside it until its index is decided,
    which adds at most a part per sender and part index held or read ahead.

    A part refused on arrival (`arrived`: a sealing sender's part whose seal does not verify, or
    that is encoded otherwise, AdaptedRunner's part stream) is held like the others and left out
    like a rejected one; `screened` then hears of every part index that left a sender out."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, *, screen: Optional[Screen] = None,
                 screened: Optional[Screened] = None):
        self._held: list[HeldPart] = []
        self.screen = screen
        self.screened = screened
        self.rejected: dict[int, str] = {}
        """Senders left out, by sender index, with the reason."""
        self.arrived: dict[tuple[int, int], tuple[Optional[PartProof], Optional[str]]] = {}
        """(sender, part index) -> what the part stream saw of a part before hivemind decoded it: its
        proof and why it is refused (AdaptedRunner._accumulate_parts_streaming). A stream reads at
        most hivemind's prefetch ahead of the parts accumulated, so this stays small."""
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        self._held = []
        super().reset_accumulators()

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        """hivemind's, holding the part instead of adding it; raises BannedException to a sender the
        screen rejected this part of."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            finished = asyncio.create_task(self.finished.wait())
            try:
                await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        proof, refusal = self.arrived.pop((sender_index, part_index), (None, None))
        self._held.append(HeldPart(sender_index, tensor_part, float(weight), proof))
        if refusal is not None:
            self.refuse(sender_index, part_index, refusal)
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        average = await current_part_future
        if self.sender_failed_after[sender_index] <= part_index:
            raise BannedException(f"sender {sender_index} was rejected: {self.rejected.get(sender_index, '?')}")
        return average

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from != self.num_current_senders:
            return
        held, part_index = self._held, self.current_part_index
        shape = self.part_shapes[part_index]
        # refused on arrival (a signing sender's part without a valid seal, or encoded otherwise)
        rejected = {part.sender: self.rejected[part.sender] for part in held
                    if self.sender_failed_after[part.sender] <= part_index and part.sender in self.rejected}
        rejected.update((part.sender, f"a part of shape {tuple(part.tensor.shape)}, expected {tuple(shape)}")
                        for part in held if part.sender not in rejected and part.tensor.shape != shape)
        if self.screen is not None:
            screened = self.screen(part_index, [part for part in held if part.sender not in rejected])
            rejected.update((sender, why) for sender, why in screened.items() if sender not in rejected)
        for sender, why in rejected.items():
            self.refuse(sender, part_index, why)
        for part in held:
            if part.sender not in rejected:
                self.accumulator.add_(part.tensor, alpha=part.weight)
                self.denominator += part.weight
        if self.screened is not None and rejected:
            try:
                self.screened(part_index, held, rejected)
            except Exception:  # noqa: BLE001 - a hook's failure must not leave the part's senders waiting
                logger.exception("the hook on part %d's left-out senders failed", part_index)
        self.current_part_future.set_result(self.accumulator.div_(self.denominator))
        self.reset_accumulators()

    def refuse(self, sender_index: int, part_index: int, why: str) -> None:
        """Leave `sender_index` out from `part_index` on, for `why`."""
        self.rejected.setdefault(sender_index, why)
        self.sender_failed_after[sender_index] = min(self.sender_failed_after[sender_index], part_index)
        for key in [key for key in self.arrived if key[0] == sender_index and key[1] > part_index]:
            del self.arrived[key]

    def on_sender_failed(self, sender_index: int) -> None:
        for key in [key for key in self.arrived if key[0] == sender_index]:
            del self.arrived[key]
        if self.sender_failed_after[sender_index] != float("inf"):
            return  # out already (rejected): not counted out of the current part a second time
        super().on_sender_failed(sender_index)


# ---- averaging: the runner ----

class AdaptedRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce with hooks and read-only views of what it lost.

    Subclasses override `after_part_sent`, `after_part_reduced` (awaited once per part, in the
    averager process), `on_reducer_failed` (values of a reducer's slice that fell back to local
    values), `screen_parts` (which senders' parts to leave out of an average) and `parts_screened`
    (what was left out of a part index, with every held part and its proof).

    With `signing`, every part this peer sends is sealed (protocol/part_evidence.py: the seal
    travels in the part message's `peer_id` bytes, which hivemind never reads on this stream), and
    as a reducer it refuses a part of a sender in `signers` (base58 peer ids: those that announced
    they seal) whose seal does not verify, or that is not float32 uncompressed. Other senders'
    parts are averaged unchecked, as hivemind does, and counted in `unsigned_parts`."""

    def __init__(self, *, signing: Optional[PartSigning] = None, signers: frozenset[str] = frozenset(), **kwargs):
        self.signing = signing
        self.signers = signers
        self.unsigned_parts: collections.Counter[str] = collections.Counter()
        """Parts received from senders that do not sign, by base58 peer id."""
        super().__init__(**kwargs)
        container = _private(self, "tensor_part_container", "AllReduceRunner")
        original = _private(container, "register_failed_reducer", "TensorPartContainer")

        def register_failed_reducer(peer_index: int) -> None:
            before = container.failed_size
            original(peer_index)
            self.on_reducer_failed(peer_index, container.failed_size - before)

        container.register_failed_reducer = register_failed_reducer
        if super().should_delay_results(self.peer_id):
            # A client-mode sender's first averaged part comes only once a reducer has its whole
            # slice (see should_delay_results), so the per-chunk reducer_timeout would count our own
            # upload against the reducer. A dead reducer is seen as its closed stream instead, and
            # allreduce_timeout_s still bounds the round.
            self.reducer_timeout = None
        # No part has arrived yet (the round starts when the runner is iterated): swap the reducer.
        stock = _private(self, "tensor_part_reducer", "AllReduceRunner")
        self.tensor_part_reducer = HoldingReducer(stock.part_shapes, stock.num_senders, screen=self.screen_parts,
                                                  screened=self.parts_screened)
        stock.finished.set()  # finalize() of an unused reducer would warn that it received 0% of its parts

    def should_delay_results(self, peer_id: Any) -> bool:
        """As a sender (`peer_id` is this peer): never, read a reducer's averaged parts while still
        sending it our slice. hivemind makes a client-mode sender finish sending first; when the
        reducer died mid-send, the failed write went unseen (its task is awaited only after the
        reads), and the sender waited out allreduce_timeout_s and lost the whole round, the live
        reducers' slices too. Reading at once sees the closed stream. As a reducer: hivemind's
        rule, which reads a client-mode sender's whole slice before answering (streaming the
        answers part by part let one sender that stopped reading stall the reducer for everyone)."""
        if peer_id == self.peer_id:
            return False
        return super().should_delay_results(peer_id)

    # hooks

    async def after_part_sent(self) -> None:
        """Called after each part this peer sent to a reducer."""

    async def after_part_reduced(self) -> None:
        """Called after each averaged part this peer, as a reducer, sent back."""

    def on_reducer_failed(self, peer_index: int, values: int) -> None:
        """A reducer failed: `values` of its slice keep this peer's local values."""

    def screen_parts(self, part_index: int, held: Sequence[HeldPart]) -> dict[int, str]:
        """As a reducer, before averaging part `part_index`: the senders (by index, see
        `local_sender`) whose parts to leave out, with the reason. Called in the averager process's
        event loop with every current sender's part; keep it cheap."""
        return {}

    def parts_screened(self, part_index: int, held: Sequence[HeldPart], rejected: dict[int, str]) -> None:
        """As a reducer, once part `part_index` is averaged and something was left out: every held
        part (with its proof where its sender signs) and why each rejected one was. Called on the
        averager process's event loop; keep it cheap, and do not keep the tensors beyond the round."""

    def own_proof(self, part_index: int, tensor: torch.Tensor) -> Optional[PartProof]:
        """This peer's own part `part_index` (which it never sends itself) sealed as it would send it
        (None without `signing`)."""
        if self.signing is None:
            return None
        values = tensor.detach().to(torch.float32).contiguous()
        buffer = values.numpy().tobytes()
        shape = tuple(values.shape)
        seal = self.signing.seal(self.group_id, part_index, self.weight, 0, "float32", shape, buffer)
        return PartProof(0, "float32", shape, buffer, float(self.weight), seal)

    def map_outgoing_parts(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Send `fn(copy of part)` instead of each part this peer sends to other reducers; its own
        slice keeps the true values (tests: a sender that poisons rounds). Call before the round."""
        parts_by_peer = _private(self.tensor_part_container, "_input_parts_by_peer", "TensorPartContainer")
        for peer_index, parts in enumerate(parts_by_peer):
            if peer_index != self.index:
                parts_by_peer[peer_index] = collections.deque((fn(part.clone()), info) for part, info in parts)

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

    @property
    def local_sender(self) -> Optional[int]:
        """This peer's sender index (what `screen_parts` receives), None if it does not send."""
        senders = list(self.sender_peer_ids)
        return senders.index(self.peer_id) if self.peer_id in senders else None

    def rejected(self) -> dict[str, str]:
        """As a reducer: the senders whose parts the screen left out, with the reason."""
        reducer = self.tensor_part_reducer
        if not isinstance(reducer, HoldingReducer):
            return {}
        return {self.sender_peer_ids[index].to_base58(): why for index, why in reducer.rejected.items()}

    # overrides of hivemind's private methods

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[Any]:
        part_index = 0
        loop = asyncio.get_running_loop()
        async for message in super()._generate_input_for_peer(peer_index):
            if self.signing is not None:  # off the loop: a part's SHA-256 takes about a millisecond
                part = message.tensor_part
                message.peer_id = await loop.run_in_executor(
                    None, self.signing.seal, self.group_id, part_index, message.weight, part.compression, part.dtype,
                    tuple(part.size), part.buffer)
            part_index += 1
            yield message
            await self.after_part_sent()

    async def _accumulate_parts_streaming(self, stream, sender_index: int) -> AsyncIterator[Any]:
        async for message in super()._accumulate_parts_streaming(self._opened(stream, sender_index), sender_index):
            yield message
            await self.after_part_reduced()

    async def _opened(self, stream: AsyncIterator[Any], sender_index: int) -> AsyncIterator[Any]:
        """The sender's part stream as hivemind reads it, each part's seal checked on the way in
        (its verdict waits in the reducer's `arrived` for the part's accumulation)."""
        sender = self.sender_peer_ids[sender_index].to_base58()
        signs = self.signing is not None and sender in self.signers
        reducer = self.tensor_part_reducer
        part_index = 0
        loop = asyncio.get_running_loop()
        async for message in stream:
            if not signs:
                self.unsigned_parts[sender] += 1
            elif isinstance(reducer, HoldingReducer) and part_index < reducer.num_parts:
                reducer.arrived[sender_index, part_index] = await loop.run_in_executor(
                    None, self._open_part, message, sender, part_index)
            part_index += 1
            yield message

    def _open_part(self, message: Any, sender: str, part_index: int) -> tuple[Optional[PartProof], Optional[str]]:
        """A signing sender's part message: its proof, and why it is refused (None: it is not)."""
        assert self.signing is not None
        part = message.tensor_part
        compression, dtype, shape, buffer = int(part.compression), str(part.dtype), tuple(part.size), part.buffer
        seal = bytes(message.peer_id)
        why = seal_refusal(seal, run_id=self.signing.run_id, stage=self.signing.stage, sender=sender,
                           group_id=self.group_id, part_index=part_index, weight=message.weight,
                           compression=compression, dtype=dtype, shape=shape, buffer=buffer)
        if why is not None:
            return None, why
        why = encoding_refusal(compression, dtype)
        if why is not None:
            return None, why
        return PartProof(compression, dtype, shape, buffer, float(message.weight), seal), None


# ---- averaging: who may call the averager ----

MAX_GATHER_BYTES = 64 * 1024
"""A join request's gathered metadata beyond this is refused undecoded (ours is under 1 KiB)."""


def decode_gather(serializer: Any, data: bytes) -> Any:
    """The user part of a peer's gathered metadata (hivemind sends `[bandwidth, mode, user
    bytes]`), or None if it is not that."""
    if not isinstance(data, bytes) or len(data) > MAX_GATHER_BYTES:
        return None
    try:
        outer = serializer.loads(data)
        if not isinstance(outer, (list, tuple)) or len(outer) != 3 or not isinstance(outer[2], bytes):
            return None
        return serializer.loads(outer[2])
    except Exception:  # noqa: BLE001 - anything undecodable is simply not metadata
        return None


class _AdmissionWrapper:
    """What the averager registers instead of itself: each averaging RPC asks the averager's
    admission hooks first, and a refused peer gets a refusal before hivemind reads its request
    (the servicer hook hivemind's own `utils/auth.py` AuthRPCWrapper uses)."""

    def __init__(self, averager: AdaptedAverager, servicer: Any):
        self._averager = averager
        self._servicer = servicer

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        gathered = decode_gather(self._averager.serializer, request.gather)
        if not await self._averager.admit_join(context.remote_id.to_base58(), gathered):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in self._servicer.rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not await self._averager.admit_part(context.remote_id.to_base58()):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in self._servicer.rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._averager.admit_state_request(context.remote_id.to_base58()):
            return  # an empty stream: hivemind's own way of saying no state here
        async for message in self._servicer.rpc_download_state(request, context):
            yield message


class GroupRefused(AllreduceException):
    """This peer will not average with the group its leader assembled."""


class AdaptedAverager(DecentralizedAverager):
    """A DecentralizedAverager whose rounds can be keyed and sized per round and instrumented, and
    whose RPCs and groups pass admission hooks.

    Subclasses override `make_runner` (build the round's runner, an AdaptedRunner) and
    `round_result` (what `step` returns), and the admission hooks `admit_join`, `admit_part`,
    `admit_state_request` and `check_group` (all admit everyone here); all run in the averager
    process."""

    # host side

    def set_round_group(self, group_bits: str, target_group_size: Optional[int],
                        leader_window_s: Optional[float] = None) -> MPFuture:
        """Set the next round's group key bits, the group size at which a leader starts and, if
        given, how long the window a leader declares lasts (hivemind fixes it at construction;
        a follower's own requests keep the constructed one). Returns the confirmation without
        waiting: the averager handles its pipe in order, so a step sent after this runs with it."""
        future = MPFuture()
        pipe = _private(self, "_outer_pipe", "DecentralizedAverager")
        pipe.send(("_agora_set_round_group", [], dict(group_bits=group_bits, size=target_group_size,
                                                      leader_window_s=leader_window_s, future=future)))
        return future

    def promote_to_reducer(self) -> MPFuture:
        """Turn a client-mode averager (a sender) into a node-mode one (a reducer) from its next
        step on: it serves the averaging RPCs, may lead a group, and gets a slice to reduce.
        hivemind fixes the mode at construction; the stage's reducer election needs it later.
        Returns the averager process's confirmation (True if it changed anything)."""
        if not self.client_mode:
            future = MPFuture()
            future.set_result(False)
            return future
        _private(self, "client_mode", "DecentralizedAverager")
        self.client_mode = False
        self.mode = AveragingMode.NODE  # step() gathers the mode on this side of the pipe
        future = MPFuture()
        pipe = _private(self, "_outer_pipe", "DecentralizedAverager")
        pipe.send(("_agora_promote", [], dict(future=future)))
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

    async def admit_join(self, peer_id: str, gathered: Any) -> bool:
        """May `peer_id` ask to join our group? `gathered` is the metadata it would bring (the
        `gather` of its step, decoded; None if undecodable)."""
        return True

    async def admit_part(self, peer_id: str) -> bool:
        """May `peer_id` send us parts to reduce? hivemind then checks it belongs to the group."""
        return True

    async def admit_state_request(self, peer_id: str) -> bool:
        """May `peer_id` download the averager's state?"""
        return True

    def check_group(self, gathered: dict[str, Any]) -> Optional[str]:
        """Before the all-reduce: why this peer refuses the group (every member's metadata by
        base58 peer id, this peer's own included), or None to go ahead."""
        return None

    async def add_p2p_handlers(self, p2p: P2P, wrapper: Any = None, *, namespace: Optional[str] = None,
                               balanced: bool = False) -> None:
        """Register the averaging RPCs behind `_AdmissionWrapper` (hivemind calls this in the
        averager process, for averagers that are not clients). Fails closed: an RPC the wrapper
        does not know would be served unchecked, so it refuses to serve at all."""
        unchecked = rpc_names(type(self)) - set(ADMITTED_RPCS)
        if unchecked:
            raise HivemindIncompatible(
                f"hivemind {hivemind.__version__}'s averager serves {', '.join(sorted(unchecked))}, which "
                f"agora-node's admission check does not cover; install hivemind=={TESTED_VERSIONS[1]}")
        await super().add_p2p_handlers(p2p, _AdmissionWrapper(self, wrapper or self), namespace=namespace,
                                       balanced=balanced)

    async def _agora_set_round_group(self, group_bits: str, size: Optional[int], future: MPFuture,
                                     leader_window_s: Optional[float] = None) -> None:
        try:
            matchmaking = _private(self, "_matchmaking", "DecentralizedAverager")
            matchmaking.group_key_manager.group_bits = group_bits
            matchmaking.target_group_size = size
            matchmaking.potential_leaders.target_group_size = size
            if leader_window_s is not None:
                matchmaking.potential_leaders.min_matchmaking_time = float(leader_window_s)
            future.set_result(None)
        except Exception as exc:  # noqa: BLE001 - reported to the host process
            future.set_exception(exc)

    async def _agora_promote(self, future: MPFuture) -> None:
        try:
            if not self.client_mode:
                future.set_result(False)
                return
            await self.add_p2p_handlers(_private(self, "_p2p", "DecentralizedAverager"), namespace=self.prefix)
            self.client_mode = False
            self.mode = AveragingMode.NODE
            _private(self, "_matchmaking", "DecentralizedAverager").client_mode = False
            future.set_result(True)
        except Exception as exc:  # noqa: BLE001 - reported to the host process
            future.set_exception(exc)

    async def _agora_probe(self, future: MPFuture) -> None:
        future.set_result(missing_attributes(self, "DecentralizedAverager", "averager process"))

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs) -> Any:
        """hivemind's own (1.1.12), except that `check_group` may refuse the group, the runner
        comes from `make_runner` and the result from `round_result`. Peers in AUX mode are not
        supported (we never use it)."""
        try:
            bandwidths, mode_ids, user_gathered_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            gathered = {peer.to_base58(): self.serializer.loads(data)
                        for peer, data in zip(group_info.peer_ids, user_gathered_bytes)}
            refusal = self.check_group(gathered)
            if refusal is not None:
                raise GroupRefused(refusal)
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
            if isinstance(exc, Exception) and not isinstance(exc, GroupRefused):
                logger.debug("all-reduce failed", exc_info=True)
            raise MatchmakingException(f"Unable to run All-Reduce: {exc}") from exc
