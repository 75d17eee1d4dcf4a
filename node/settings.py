"""Node settings: flags override `AGORA_*` environment variables, which override the config
file's optional `node:` section, which overrides the defaults below."""

from __future__ import annotations

import os
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from protocol.errors import ConfigError

LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"


class NodeSettings(BaseModel):
    """Everything one `agora-node` process needs besides the run config itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["worker", "trainer"] = Field(description="what this node does in the run")
    config: Optional[str] = Field(default=None, description="run config: a preset name (tiny, 1b, 8b) or a YAML "
                                  "path; with --authorizer the run's own config is used")
    authorizer: Optional[str] = Field(default=None, description="URL of the run's authorizer, e.g. http://host:8000")
    account_token: str = Field(default="", description="account token the run owner gave you, if any")
    insecure_open_run: bool = Field(default=False, description="run without an authorizer: any peer is trusted")
    revocation_refresh_s: float = Field(default=30.0, gt=0, description="how often revocations are re-read")
    stage: Optional[int] = Field(default=None, ge=0, description="pipeline stage a worker serves")
    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of peers already in the run")
    host_maddrs: list[str] = Field(default_factory=lambda: [LOOPBACK_MADDR], description="where to listen")
    announce_maddrs: list[str] = Field(default_factory=list, description="addresses to advertise, if not host_maddrs")
    identity: Optional[str] = Field(default=None, description="file holding the libp2p key; keeps the peer id")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch: int = Field(default=8, ge=1, le=4096, description="largest coalesced batch a worker runs")
    dry_run: bool = Field(default=False, description="print the worker's memory plan and exit")
    lanes: int = Field(default=4, ge=1, le=256, description="samples a trainer keeps in flight at once")
    data: str = Field(default="synthetic", description="'synthetic' or a path to .txt/.jsonl files")
    tokenizer: Optional[str] = Field(default=None, description="tokenizers JSON file; default is byte-level")
    max_samples: Optional[int] = Field(default=None, ge=1, description="trainer stops after this many samples")
    shard_index: int = Field(default=0, ge=0, description="this trainer's data shard")
    num_shards: int = Field(default=1, ge=1, description="how many trainers share the data")
    bootstrap_timeout_s: float = Field(default=30.0, gt=0, description="how long to try reaching initial peers")
    torch_threads: Optional[int] = Field(default=None, ge=1, description="intra-op threads for torch compute")
    discovery_period_s: float = Field(default=5.0, gt=0, description="how often a trainer re-reads the DHT")
    announce_period_s: float = Field(default=5.0, gt=0, description="how often a node re-announces itself")
    request_timeout_s: float = Field(default=30.0, gt=0, description="deadline for one RPC to a worker")
    reducer: bool = Field(default=False, description="worker: reduce slices in averaging rounds (stable nodes only)")
    state_source: Literal["auto", "peers", "checkpoint", "none"] = Field(
        default="auto", description="worker: where to load the stage's parameters when joining a running stage")
    checkpoint_dir: Optional[str] = Field(default=None, description="worker: directory of stage checkpoints")
    checkpoint_period_s: Optional[float] = Field(
        default=None, gt=0, description="worker: write a checkpoint to --checkpoint-dir at start and this often")
    test_init_seed_offset: int = Field(default=0, ge=0, description="TESTS ONLY: other initial weights")
    test_averaging_stall_s: float = Field(default=0.0, ge=0, description="TESTS ONLY: stall mid-round this long")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("initial_peers", "host_maddrs", "announce_maddrs")
    @classmethod
    def _valid_multiaddrs(cls, values: list[str]) -> list[str]:
        from hivemind.utils.multiaddr import Multiaddr

        for value in values:
            try:
                Multiaddr(value)
            except Exception as exc:
                raise ValueError(
                    f"{value!r} is not a multiaddr; expected e.g. /ip4/127.0.0.1/tcp/31337/p2p/Qm..."
                ) from exc
        return values


_LIST_FIELDS = {"initial_peers", "host_maddrs", "announce_maddrs"}
_BOOL_FIELDS = {"dry_run", "insecure_open_run", "reducer"}


def _from_env(environ: dict[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in NodeSettings.model_fields:
        raw = environ.get(f"AGORA_{name.upper()}")
        if raw is None or raw == "":
            continue
        if name in _LIST_FIELDS:
            values[name] = [item for item in raw.replace(",", " ").split() if item]
        elif name in _BOOL_FIELDS:
            values[name] = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            values[name] = raw
    return values


def _from_config_file(config: Optional[str]) -> dict[str, Any]:
    if not config or not (config.endswith((".yaml", ".yml")) and os.path.isfile(config)):
        return {}
    try:
        with open(config) as f:
            document = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return {}  # the run-config loader reports the precise problem
    section = document.get("node", {}) if isinstance(document, dict) else {}
    if not isinstance(section, dict):
        raise ConfigError(f"config {config}: the 'node' section must be a mapping of setting: value")
    return section


def build_settings(flags: dict[str, Any], environ: Optional[dict[str, str]] = None) -> NodeSettings:
    """Merge the three sources; the first validation error becomes a one-line ConfigError."""
    environ = dict(os.environ) if environ is None else environ
    env_values = _from_env(environ)
    flag_values = {k: v for k, v in flags.items() if v is not None and v != [] and v is not False}
    config = flag_values.get("config") or env_values.get("config")
    merged = {**_from_config_file(config), **env_values, **flag_values}
    if not merged.get("config") and not merged.get("authorizer"):
        raise ConfigError("--config is required (or --authorizer, which provides the run's config)")
    try:
        return NodeSettings.model_validate(merged)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"]) or "settings"
        flag = f"--{field.split('.')[0].replace('_', '-')}"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "missing":
            raise ConfigError(f"{flag} is required") from None
        raise ConfigError(f"{flag}: {message} (got {error.get('input')!r})") from None
