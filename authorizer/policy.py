"""The live admission policy: capacities, join rate, hardware floors, accepted builds, checks.

The report keeps these operator-tunable values in Redis so a run's admission rules can change
while it is in progress [report 3.6.1.1]; we keep them in the authorizer's own database (one JSON row),
so a restart keeps what the operator last set, and read them from memory on every request.
At start-up the policy is: what the database holds (or defaults derived from the run config),
with the explicit settings of the policy file and the command line applied on top.

Default hardware floors come from the memory plan of each stage at a coalescing cap of one, so a
node is never admitted to a stage it cannot even hold; the tail (LM head) and head (embedding)
floors come out higher than the bodies', which is what steers strong nodes to them [report 3.6.1.4].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from protocol.errors import ConfigError
from protocol.version import client_version
from protocol.run_config import RunConfig
from roles.model.memory_plan import plan_memory

StageClass = Literal["head", "body", "tail", "trainer"]
CheckName = Literal["capability", "integrity", "reachability", "accountability"]
CHECK_NAMES: tuple[str, ...] = ("capability", "integrity", "reachability", "accountability")
TRAINER_POOL = -1
"""Pool id of trainers in the capacity counters; stages use their index."""

_MODEL = ConfigDict(extra="forbid", frozen=True)
_MAX_STAGES = 1024
_MAX_NODES = 1_000_000


class HardwareFloor(BaseModel):
    """The least a node must bring to serve one class of stage (or to be a trainer)."""

    model_config = _MODEL

    min_vram_bytes: int = Field(default=0, ge=0, le=1 << 50, description="accelerator memory")
    min_ram_bytes: int = Field(default=0, ge=0, le=1 << 50, description="host memory")
    min_bandwidth_mbps: float = Field(default=0.0, ge=0, le=1e7, description="measured bandwidth")
    max_latency_ms: Optional[float] = Field(
        default=None, ge=0, le=1e7, description="highest measured latency; None means no limit"
    )


class Checks(BaseModel):
    """Which admission checks run [report 3.6.1.2]; each can be switched off on its own."""

    model_config = _MODEL

    capability: bool = Field(default=True, description="hardware floors and accelerator allow-list")
    integrity: bool = Field(default=True, description="client version and package digest accepted")
    reachability: bool = Field(default=True, description="the authorizer dials the announced address")
    accountability: bool = Field(
        default=False,
        description="accounts required: only tokens the owner issued (accounts add) and has not revoked pass, "
                    "and nodes per account are capped; off, a token is not verified (revoked and banned ones "
                    "are still refused)",
    )


class Policy(BaseModel):
    """Everything an operator may change while the run is in progress."""

    model_config = _MODEL

    stage_capacity: list[int] = Field(
        max_length=_MAX_STAGES, description="most workers admitted per stage; never exceeded"
    )
    stage_target: Optional[list[int]] = Field(
        default=None, max_length=_MAX_STAGES,
        description="workers wanted per stage; placement fills the stage furthest below it (default: capacity)",
    )
    trainer_capacity: int = Field(default=64, ge=0, le=_MAX_NODES, description="most trainers admitted")
    join_rate_per_s: float = Field(default=5.0, ge=0.001, le=1e6, description="queue releases per second")
    join_burst: int = Field(default=10, ge=1, le=1_000_000, description="releases allowed back to back")
    floors: dict[StageClass, HardwareFloor] = Field(default_factory=dict, description="per stage class")
    accelerators: list[str] = Field(
        default_factory=list, max_length=256,
        description="allowed device names (case-insensitive substrings); empty allows any",
    )
    client_versions: list[str] = Field(
        default_factory=list, max_length=256, description="accepted client versions; empty accepts any"
    )
    package_digests: list[str] = Field(
        default_factory=list, max_length=4096, description="accepted package digests; empty accepts any"
    )
    checks: Checks = Field(default_factory=Checks)
    max_nodes_per_account: int = Field(default=16, ge=1, le=_MAX_NODES, description="live nodes per account")
    max_queue: int = Field(default=10_000, ge=0, le=_MAX_NODES, description="tickets waiting at most")
    queue_idle_timeout_s: float = Field(
        default=300.0, ge=1, le=86400, description="a queued ticket not polled for this long is dropped"
    )
    dial_private_addresses: bool = Field(
        default=True, description="reachability may dial loopback/private addresses (turn off for public runs)"
    )
    bandwidth_floor_from_plan: Literal["off", "bf16", "fp32"] = Field(
        default="off", description="raise each stage's bandwidth floor to the run's bandwidth plan for it "
                                   "(agora-node plan: activations plus the averaging burst, with averaging in "
                                   "this dtype; our averager sends fp32)"
    )
    reducer_accounts: list[str] = Field(
        default_factory=list, max_length=256,
        description="accounts whose workers are designated reducers at placement (the run owner's own stable, "
                    "well-connected machines); other workers only send, unless their stage elects them",
    )
    evidence_quorum: int = Field(
        default=2, ge=1, le=1000,
        description="reporters of this many different accounts must report a worker's two-replica contradiction "
                    "(the only other replica of its stage contradicts it; the reporter's loss measurement says "
                    "which lied) before its account is banned; with a third replica one report is proof enough",
    )
    evidence_trusted_accounts: list[str] = Field(
        default_factory=list, max_length=256,
        description="accounts whose reporters' two-replica contradictions ban at once (the run owner's own "
                    "trainers)",
    )
    honor_stage_preference: bool = Field(
        default=False, description="place a worker on the stage it asks for (--stage) when it may serve it and "
                                   "the stage has room, instead of the stage furthest below its target (the run "
                                   "owner's own machines, network labs)"
    )

    @model_validator(mode="after")
    def _check(self) -> Policy:
        if any(not 0 <= c <= _MAX_NODES for c in self.stage_capacity):
            raise ValueError(f"stage_capacity values must lie in 0..{_MAX_NODES}")
        if self.stage_target is not None:
            if len(self.stage_target) != len(self.stage_capacity):
                raise ValueError("stage_target needs one value per stage, like stage_capacity")
            if any(not 0 <= t <= _MAX_NODES for t in self.stage_target):
                raise ValueError(f"stage_target values must lie in 0..{_MAX_NODES}")
        for field in ("accelerators", "client_versions", "package_digests", "reducer_accounts",
                      "evidence_trusted_accounts"):
            if any(not 0 < len(v) <= 128 for v in getattr(self, field)):
                raise ValueError(f"{field} entries must be 1-128 characters")
        return self

    def capacity(self, pool: int) -> int:
        """Capacity of a pool; 0 for a stage the run no longer has (its tickets are not admitted)."""
        if pool == TRAINER_POOL:
            return self.trainer_capacity
        return self.stage_capacity[pool] if 0 <= pool < len(self.stage_capacity) else 0

    def target(self, stage: int) -> int:
        return (self.stage_target or self.stage_capacity)[stage]

    def floor(self, stage_class: str) -> HardwareFloor:
        return self.floors.get(stage_class, HardwareFloor())  # type: ignore[call-overload]

    def for_run(self, run: RunConfig) -> Policy:
        """Refuse a policy that does not fit the run's stage count (one ConfigError line)."""
        if len(self.stage_capacity) != run.num_stages:
            raise ConfigError(
                f"policy has {len(self.stage_capacity)} stage capacities but run {run.run_id} has "
                f"{run.num_stages} stages; give one capacity per stage"
            )
        return self


def default_floors(run: RunConfig) -> dict[str, HardwareFloor]:
    """Per stage class, the memory a replica needs at max_batch 1 (the largest stage of the class)."""
    floors: dict[str, HardwareFloor] = {}
    for index in range(run.num_stages):
        kind = run.stage_kind(index)
        plan = plan_memory(run, index, "cuda:0", 1)
        current = floors.get(kind, HardwareFloor())
        floors[kind] = HardwareFloor(
            min_vram_bytes=max(current.min_vram_bytes, plan.device_bytes),
            min_ram_bytes=max(current.min_ram_bytes, plan.host_bytes),
        )
    floors["trainer"] = HardwareFloor()
    return floors


def default_policy(run: RunConfig) -> Policy:
    return Policy(
        stage_capacity=[64] * run.num_stages,
        floors=default_floors(run),  # type: ignore[arg-type]
        client_versions=[client_version()],
    )


def merge_policy(base: Policy, overrides: dict[str, Any], *, source: str) -> Policy:
    """`base` with `overrides` applied (nested `floors`/`checks` merge per key); one ConfigError
    line naming `source` and the field if the result is invalid."""
    data = base.model_dump()
    for key, value in overrides.items():
        if key in ("floors", "checks") and isinstance(value, dict) and isinstance(data.get(key), dict):
            merged = dict(data[key])
            for sub, subvalue in value.items():
                if key == "floors" and isinstance(subvalue, dict) and isinstance(merged.get(sub), dict):
                    merged[sub] = {**merged[sub], **subvalue}
                else:
                    merged[sub] = subvalue
            data[key] = merged
        else:
            data[key] = value
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error.get("loc", ()))
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        raise ConfigError(f"{source}: {where + ': ' if where else ''}{message}") from exc


def load_policy_file(path: str) -> dict[str, Any]:
    """Read a YAML mapping of Policy fields (any subset)."""
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"policy file {path} does not exist; fix --policy-file") from exc
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"policy file {path} cannot be read as YAML ({exc}); fix it") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"policy file {path} must hold a mapping of policy fields")
    unknown = set(data) - set(Policy.model_fields)
    if unknown:
        raise ConfigError(
            f"policy file {path}: unknown field(s) {', '.join(sorted(map(str, unknown)))}; "
            f"known fields are {', '.join(Policy.model_fields)}"
        )
    return data

