"""The admission checks that need no network: capability, integrity and the account rules.

Screening happens at the door rather than after a node has joined, so that a node that would
degrade or endanger the run never disturbs it [report 3.6.1.2]. Each check is switched on or off in the
policy. A failed check is not an error but a `Rejection`: a machine-readable `RejectReason` and a
sentence telling the user what to do. Reachability (dialing the node back) lives in
authorizer.reachability; capacity and bans are decided in the store's transaction.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Optional

from authorizer.policy import HardwareFloor, Policy
from protocol.authorizer_api import RejectReason  # noqa: F401 - the wire codes, re-exported
from protocol.run_config import RunConfig

_GIB = float(1 << 30)

MONITOR_POOL = -2
"""Pool id of the run owner's own nodes, health monitors and relays, in the capacity counters
(stages use their index, trainers -1)."""
MAX_MONITORS = 16
"""Monitors and relays admitted at once: they hold no stage or trainer slot, but each one is a peer."""
OWNER_ROLES = ("monitor", "relay")
"""Roles only the run's owner may start (the admin token), placed in MONITOR_POOL."""
MONITOR_ACCOUNT = "monitor"
"""The account monitors are recorded under: their token is the admin token, whose hash is never stored."""


@dataclass(frozen=True)
class Rejection:
    reason: RejectReason
    message: str


@dataclass(frozen=True)
class HardwareClaim:
    """What a joining node reports about itself (authorizer.models.Hardware, unbound from HTTP)."""

    device_name: str
    vram_bytes: int
    ram_bytes: int
    bandwidth_mbps: float
    latency_ms: float


def account_id(token: str) -> str:
    """Accounts are stored under the SHA-256 of their token, never the token itself."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest() if token else "anonymous"


def new_account_token() -> str:
    """A fresh account token: 32 random bytes, URL-safe (fits --account-token's printable ASCII)."""
    return "agora-" + secrets.token_urlsafe(32)


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f} GiB"


def check_floor(floor: HardwareFloor, hw: HardwareClaim, what: str) -> Optional[Rejection]:
    """None if `hw` meets `floor`. A node without accelerator memory (vram 0, e.g. a CPU worker)
    computes in host RAM, so it needs the device and host requirements together in RAM."""
    if hw.vram_bytes == 0 and floor.min_vram_bytes > 0:
        need = floor.min_vram_bytes + floor.min_ram_bytes
        if hw.ram_bytes < need:
            return Rejection(RejectReason.INSUFFICIENT_RAM, (
                f"{what} needs {_gib(need)} of host RAM on a node without accelerator memory, but this "
                f"node reports {_gib(hw.ram_bytes)}; add a GPU with at least {_gib(floor.min_vram_bytes)} "
                f"or use a machine with more RAM"))
    else:
        if hw.vram_bytes < floor.min_vram_bytes:
            return Rejection(RejectReason.INSUFFICIENT_VRAM, (
                f"{what} needs at least {_gib(floor.min_vram_bytes)} of accelerator memory but "
                f"{hw.device_name} reports {_gib(hw.vram_bytes)}; use a larger GPU or free memory "
                f"held by other programs"))
        if hw.ram_bytes < floor.min_ram_bytes:
            return Rejection(RejectReason.INSUFFICIENT_RAM, (
                f"{what} needs at least {_gib(floor.min_ram_bytes)} of host RAM but this node reports "
                f"{_gib(hw.ram_bytes)}; close other programs or use a machine with more RAM"))
    if hw.bandwidth_mbps < floor.min_bandwidth_mbps:
        return Rejection(RejectReason.INSUFFICIENT_BANDWIDTH, (
            f"{what} needs at least {floor.min_bandwidth_mbps:g} Mbit/s but this node measured "
            f"{hw.bandwidth_mbps:g} Mbit/s; use a faster connection or stop other transfers"))
    if floor.max_latency_ms is not None and hw.latency_ms > floor.max_latency_ms:
        return Rejection(RejectReason.LATENCY_TOO_HIGH, (
            f"{what} needs a latency of at most {floor.max_latency_ms:g} ms but this node measured "
            f"{hw.latency_ms:g} ms; join from a network closer to the run's peers"))
    return None


def stage_floor(run: RunConfig, policy: Policy, index: int) -> HardwareFloor:
    """The policy's floor for the stage's kind, its bandwidth raised to the run's bandwidth plan for
    the stage when `policy.bandwidth_floor_from_plan` says so [report 3.5.2.1]."""
    floor = policy.floor(run.stage_kind(index))
    if policy.bandwidth_floor_from_plan == "off":
        return floor
    from roles.model.traffic_plan import plan_traffic  # arithmetic on the run config, no torch

    stage = plan_traffic(run, stages=[index]).stage(index)
    planned = stage.total_mbps_bf16 if policy.bandwidth_floor_from_plan == "bf16" else stage.total_mbps_fp32
    return floor.model_copy(update={"min_bandwidth_mbps": max(floor.min_bandwidth_mbps, round(planned, 1))})


def check_capability(
    run: RunConfig, policy: Policy, role: str, hw: HardwareClaim
) -> tuple[list[int], Optional[Rejection]]:
    """The stages a worker may serve (all of them if the check is off), or why none.

    For a trainer the list is empty and only the trainer floor applies. When no stage fits, the
    rejection is the one of the least demanding stage, the one the node came closest to.
    """
    stages = list(range(run.num_stages))
    if not policy.checks.capability:
        return (stages if role == "worker" else []), None
    if policy.accelerators:
        name = hw.device_name.lower()
        if not any(allowed.lower() in name for allowed in policy.accelerators):
            return [], Rejection(RejectReason.ACCELERATOR_NOT_ALLOWED, (
                f"this run accepts only {', '.join(policy.accelerators)} accelerators, not "
                f"{hw.device_name!r}; join with one of those devices"))
    if role == "trainer":
        return [], check_floor(policy.floor("trainer"), hw, "a trainer")
    fitting, failures = [], []
    for index in stages:
        kind = run.stage_kind(index)
        floor = stage_floor(run, policy, index)
        failure = check_floor(floor, hw, f"stage {index} ({kind})")
        if failure is None:
            fitting.append(index)
        else:
            failures.append(((floor.min_vram_bytes + floor.min_ram_bytes, floor.min_bandwidth_mbps), failure))
    if fitting:
        return fitting, None
    return [], min(failures, key=lambda item: item[0])[1]


def check_integrity(policy: Policy, client_version: str, package_digest: str) -> Optional[Rejection]:
    """The node must run a build the operator accepts: a listed version and package digest."""
    if not policy.checks.integrity:
        return None
    if policy.client_versions and client_version not in policy.client_versions:
        return Rejection(RejectReason.CLIENT_VERSION_NOT_ACCEPTED, (
            f"client version {client_version} is not accepted by this run (accepted: "
            f"{', '.join(policy.client_versions[:8])}); install one of those with pip and rejoin"))
    if policy.package_digests and package_digest not in policy.package_digests:
        return Rejection(RejectReason.PACKAGE_DIGEST_NOT_ACCEPTED, (
            f"package digest {package_digest[:24] or '(none)'} does not match an accepted agora-node build; "
            f"reinstall agora-node from the official release without local changes and rejoin"))
    return None


def check_account_token(policy: Policy, token: str) -> Optional[Rejection]:
    """The part of the account rules that needs no database: a token is there when required.

    Accounts are required when the policy's `accountability` check is on. Then only tokens the
    run's owner issued (`agora-node --role authorizer accounts add`) and has not revoked pass, and
    each account runs at most `max_nodes_per_account` nodes (decided in the store's transaction).
    When accounts are not required a token is not verified: any node meeting the other checks
    joins, and an unknown token is accepted as is; but a token the owner revoked or banned is
    still refused, because the owner said so explicitly.
    """
    if policy.checks.accountability and not token:
        return Rejection(RejectReason.ACCOUNT_REQUIRED, (
            "this run admits only nodes with an account token from the run's owner; ask them for one "
            "(they create it with `agora-node --role authorizer accounts add`), pass it with --account-token "
            "and rejoin"))
    return None


def check_monitor_token(token: str, admin_token: Optional[str], role: str = "monitor") -> Optional[Rejection]:
    """A monitor reads the whole run and a relay carries other nodes' traffic, and both are recorded
    as the operator's own nodes, so only the run's owner may start one: its account token must be
    the authorizer's admin token."""
    if admin_token and token and hmac.compare_digest(token.encode(), admin_token.encode()):
        return None
    if role == "relay":
        return Rejection(RejectReason.MONITOR_NOT_AUTHORIZED, (
            "a relay must present the run owner's admin token as its account token; pass --account-token with "
            "the authorizer's admin token (its admin.token file)"))
    return Rejection(RejectReason.MONITOR_NOT_AUTHORIZED, (
        "a health monitor must present the run owner's admin token as its account token; pass "
        "--account-token with the authorizer's admin token (its admin.token file), or run the monitor inside "
        "the authorizer (the default)"))


def accounts_line(policy: Policy) -> str:
    """The one line an authorizer logs at start so its operator knows where accounts stand."""
    if policy.checks.accountability:
        return ("accounts: required; create tokens with `agora-node --role authorizer accounts add` "
                f"(at most {policy.max_nodes_per_account} live nodes per account)")
    return ("accounts: not required (any node meeting the checks may join); require them with "
            "--checks ...,accountability")


def unknown_account_rejection() -> Rejection:
    return Rejection(RejectReason.UNKNOWN_ACCOUNT, (
        "this account token was not issued by the run's owner; check --account-token for typos, or ask the "
        "owner for a token (`agora-node --role authorizer accounts add`)"))


def revoked_account_rejection() -> Rejection:
    return Rejection(RejectReason.REVOKED_ACCOUNT, (
        "the run's owner revoked this account token; ask them for a new one"))


REPLACED_MESSAGE = ("this peer joined again (a restart with the same identity); the newer ticket replaced this "
                    "one and its credentials were revoked")


def banned_account_rejection() -> Rejection:
    return Rejection(RejectReason.BANNED_ACCOUNT, (
        "the operator has banned this account from the run; contact the operator if you think this is a mistake"))


def banned_peer_rejection(peer_id: str) -> Rejection:
    return Rejection(RejectReason.BANNED_PEER, (
        f"the operator has banned peer {peer_id}; contact the operator if you think this is a mistake"))


def account_limit_rejection(limit: int) -> Rejection:
    return Rejection(RejectReason.ACCOUNT_LIMIT, (
        f"your account already runs {limit} node(s), the most this run allows; stop one of them "
        f"(agora-node leaves on SIGTERM) and rejoin"))


def run_full_rejection(role: str, stages: list[int]) -> Rejection:
    what = "trainer slots" if role == "trainer" else (
        f"stage(s) {', '.join(map(str, stages))} that this node can serve" if stages else "stages")
    return Rejection(RejectReason.RUN_FULL, (
        f"all {what} are at capacity; retry in a few minutes (GET /v1/run shows free slots)"))


def queue_full_rejection(limit: int) -> Rejection:
    return Rejection(RejectReason.QUEUE_FULL, (
        f"the admission queue already holds {limit} nodes, its maximum; retry in a few minutes"))
