"""The authorizer's process settings: where it listens, stores, keeps its key, and how it starts.

The authorizer keeps its address: it listens on port 8000 unless told otherwise, and it records
the settings that make up its address and identity (host, bound port, database URL, run config)
in `<data_dir>/authorizer.json`. Started again with the same command, it reads them back, so it
serves the same URL with the same root key even if it was first started with `--port 0`; a flag
given explicitly overrides the stored value (and is stored in its place). The data directory
defaults to `$XDG_DATA_HOME/agora-node/authorizer` (`~/.local/share/agora-node/authorizer`).

Policy-shaped settings (capacities, join rate, checks) are optional here: `None` means "keep what
the database holds" (the operator may have changed it live through the admin API), while a value
given on the command line or in the policy file overrides it at every start (authorizer.policy).

The rate limits (authorizer.ratelimit) and how many rejected joins a source may leave as tickets
(authorizer.rejections) are process settings: each authorizer of a run limits what reaches it.
Their defaults let a fleet of a few hundred nodes behind one NAT address start together and let a
queued node poll as often as agora-node does (at most 5 a second), while a flood from one address
is answered 429 after its burst (docs/operations.md, "Rate limits").
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, SecretStr, field_validator

from authorizer.policy import CHECK_NAMES
from protocol.errors import ConfigError
from protocol.files import atomic_write
from roles.settings_base import LoggingSettings, check_multiaddrs

DEFAULT_PORT = 8000
STORED_SETTINGS_FILE = "authorizer.json"
STORED_FIELDS = ("host", "port", "db", "run_config")
"""What `authorizer.json` keeps: the settings that make up the authorizer's address and identity."""


def default_data_dir() -> str:
    """`$XDG_DATA_HOME/agora-node/authorizer`, by default `~/.local/share/agora-node/authorizer`."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "agora-node", "authorizer")


def load_stored_settings(data_dir: str) -> dict[str, Any]:
    """The settings a previous start recorded in `data_dir`, or {} on a first start."""
    path = os.path.join(data_dir, STORED_SETTINGS_FILE)
    try:
        with open(path, encoding="utf-8") as handle:
            stored = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); fix or delete it (it is rewritten at the next start)") from exc
    if not isinstance(stored, dict):
        raise ConfigError(f"{path} does not hold a JSON object; fix or delete it")
    return {k: v for k, v in stored.items() if k in STORED_FIELDS and v is not None}


def save_stored_settings(data_dir: str, values: dict[str, Any]) -> None:
    """Record `values` in `data_dir/authorizer.json` atomically (a crash leaves the old file or the new)."""
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    data = json.dumps({k: values.get(k) for k in STORED_FIELDS}, indent=2) + "\n"
    atomic_write(os.path.join(data_dir, STORED_SETTINGS_FILE), data.encode(), mode=0o600)
DEFAULT_CREDENTIAL_TTL_S = 30 * 60
"""protocol.credentials.DEFAULT_CREDENTIAL_TTL_S, restated: importing that module loads hivemind
and torch (seconds), and bad flags should fail at once (tests pin the two equal)."""


class AuthorizerConfig(LoggingSettings):
    """Everything one authorizer process needs; `agora-node --role authorizer` builds it from flags
    (its logging settings are the nodes', from roles/settings_base.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_config: str = Field(default="tiny", json_schema_extra={"flag": "config", "aliases": ["--run-config"], "metavar": "NAME|PATH",
                                                               "default_text": "as last time, else tiny"},
                            description="run config: a preset (tiny, 1b, 8b) or a YAML path")
    host: str = Field(default="127.0.0.1", max_length=255, json_schema_extra={"default_text": "as last time, else "
                                                                                "127.0.0.1"},
                      description="HTTP listen address (0.0.0.0: every interface)")
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535,
                      json_schema_extra={"default_text": f"as last time, else {DEFAULT_PORT}"},
                      description="HTTP port; 0 binds a free one (printed when ready, then kept for restarts)")
    data_dir: str = Field(default_factory=default_data_dir, json_schema_extra={
        "metavar": "DIR", "default_text": "$XDG_DATA_HOME/agora-node/authorizer"},
        description="holds authorizer.json, the SQLite file, the root key and the admin token")
    db: Optional[str] = Field(
        default=None, json_schema_extra={"metavar": "URL"},
        description="sqlite:///path or postgresql://user@host/db; default: SQLite in the data directory"
    )
    key_path: Optional[str] = Field(default=None, json_schema_extra={"metavar": "PATH"},
                                    description="Ed25519 root key file (0600); default: root.key in the data directory")
    admin_token: Optional[SecretStr] = Field(default=None, json_schema_extra={"metavar": "TOKEN"},
                                             description="bearer token of the admin API (prefer --admin-token-file)")
    admin_token_file: Optional[str] = Field(
        default=None, json_schema_extra={"metavar": "PATH"},
        description="file holding the admin token; created (0600) with a random one if missing; default: "
                    "admin.token in the data directory"
    )
    policy_file: Optional[str] = Field(default=None, json_schema_extra={"metavar": "PATH"},
                                       description="YAML with any subset of the policy fields (docs/operations.md)")
    credential_ttl_s: int = Field(
        default=DEFAULT_CREDENTIAL_TTL_S, ge=10, le=7 * 86400, description="lifetime of an issued credential"
    )
    join_rate_per_s: Optional[float] = Field(default=None, ge=0.001, le=1e6, json_schema_extra={"flag": "join-rate", "metavar": "RATE"},
                                             description="queue releases per second (policy; default 5)")
    join_burst: Optional[int] = Field(default=None, ge=1, le=1_000_000,
                                      description="releases back to back (policy; default 10)")
    stage_capacity: Optional[list[int]] = Field(
        default=None, json_schema_extra={"comma_list": True, "metavar": "N[,N...]"},
        description="workers per stage: one value for every stage, or one per stage (policy)"
    )
    trainer_capacity: Optional[int] = Field(default=None, ge=0, description="trainers admitted at most (policy)")
    checks: Optional[list[str]] = Field(
        default=None, json_schema_extra={"comma_list": True, "metavar": "CHECK[,CHECK...]"},
        description=f"enabled admission checks: a subset of {','.join(CHECK_NAMES)}, or none (policy)"
    )
    bootstrap_peers: list[str] = Field(
        default_factory=list, max_length=64, json_schema_extra={"metavar": "MADDR"},
        description="multiaddrs handed to admitted nodes as initial peers"
    )
    reachability_timeout_s: float = Field(default=5.0, gt=0, le=60, description="deadline of one dial-back")
    source_join_rate_per_s: float = Field(
        default=10.0, gt=0, le=1e6, json_schema_extra={"flag": "source-join-rate", "metavar": "RATE"},
        description="joins a second one source address (IPv6: a /64) may send once its burst is spent; more "
                    "are answered 429 with Retry-After")
    source_join_burst: int = Field(default=300, ge=1, le=1_000_000,
                                   description="joins one source address may send at once")
    source_request_rate_per_s: float = Field(
        default=20.0, gt=0, le=1e6, json_schema_extra={"flag": "source-request-rate", "metavar": "RATE"},
        description="polls, renewals and leaves a second from one source address that prove no node this "
                    "authorizer knows live (an unknown ticket, a bad signature)")
    source_request_burst: int = Field(default=300, ge=1, le=1_000_000,
                                      description="such requests one source address may send at once")
    node_request_rate_per_s: float = Field(
        default=10.0, gt=0, le=1e6, json_schema_extra={"flag": "node-request-rate", "metavar": "RATE"},
        description="polls, renewals and leaves a second of one live node that proves its key or ticket, "
                    "whatever its address")
    node_request_burst: int = Field(default=50, ge=1, le=1_000_000,
                                    description="such requests one node may send at once")
    evidence_rate_per_min: float = Field(
        default=6.0, gt=0, le=1e6, json_schema_extra={"flag": "evidence-rate", "metavar": "RATE"},
        description="evidence reports a minute one live node may send (POST /v1/evidence) once its burst is "
                    "spent; more are answered 429 with Retry-After")
    evidence_burst: int = Field(default=6, ge=1, le=1_000_000,
                                description="evidence reports one live node may send at once")
    rejection_detail_rate_per_s: float = Field(
        default=0.2, gt=0, le=1e6, json_schema_extra={"flag": "rejection-detail-rate", "metavar": "RATE"},
        description="rejected joins a second one source address may leave as tickets once its burst is "
                    "spent; the others are counted per source, reason and minute")
    rejection_detail_burst: int = Field(default=200, ge=1, le=1_000_000,
                                        description="rejected joins one source address may leave as tickets at once")
    rate_limit_sources: int = Field(
        default=50_000, ge=1, le=10_000_000,
        description="source addresses, and nodes, the rate limits keep track of at once (the least recently "
                    "seen are forgotten)")
    no_monitor: bool = Field(default=False, description="do not run the health monitor in this process (run "
                             "`agora-node --role monitor` elsewhere, or nothing)")
    monitor_interval_s: float = Field(default=10.0, ge=0.5, le=3600.0, description="how often the health monitor "
                                      "reads the DHT and records what it saw")
    monitor_host_maddrs: list[str] = Field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"],
                                           json_schema_extra={"metavar": "MADDR"},
                                           description="where the in-process health monitor's DHT node listens; "
                                                       "nodes get it as a bootstrap peer")
    alert_webhook: Optional[str] = Field(default=None, json_schema_extra={"metavar": "URL"},
                                         description="POST each new or resolved alert as JSON to this URL")
    pushgateway: Optional[str] = Field(default=None, json_schema_extra={"metavar": "URL"},
                                       description="Prometheus Pushgateway that nodes' authenticated pushes to "
                                                   "/v1/metrics/push are forwarded to (off if unset)")
    sqlite_synchronous: Literal["full", "normal"] = Field(
        default="full", description="full: a commit survives power loss; normal: survives a process crash"
    )

    @field_validator("monitor_host_maddrs")
    @classmethod
    def _monitor_multiaddrs(cls, values: list[str]) -> list[str]:
        return check_multiaddrs(values)

    @field_validator("stage_capacity", "checks", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """Flags give these as one comma-separated word ("8,4,8"; "none" for no checks)."""
        if isinstance(value, str):
            if value.strip() == "none":
                return []
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("checks")
    @classmethod
    def _known_checks(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        if value is not None:
            unknown = [c for c in value if c not in CHECK_NAMES]
            if unknown:
                raise ValueError(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECK_NAMES)}")
        return value

    @field_validator("stage_capacity")
    @classmethod
    def _capacities(cls, value: Optional[list[int]]) -> Optional[list[int]]:
        if value is not None and (not value or any(c < 0 for c in value)):
            raise ValueError("stage capacity needs one or more non-negative integers")
        return value

    def db_url(self) -> str:
        """The SQLAlchemy URL; plain postgresql:// is mapped to the psycopg 3 driver."""
        url = self.db or f"sqlite:///{os.path.join(self.data_dir, 'authorizer.db')}"
        for prefix in ("postgresql://", "postgres://"):
            if url.startswith(prefix):
                return "postgresql+psycopg://" + url[len(prefix):]
        if url.startswith(("sqlite:///", "postgresql+psycopg://")):
            return url
        raise ConfigError(f"--db {url!r} is not supported; use sqlite:///path/to/file.db or postgresql://user@host/db")

    def resolved_key_path(self) -> str:
        return self.key_path or os.path.join(self.data_dir, "root.key")

    def policy_overrides(self, num_stages: int) -> dict[str, Any]:
        """The policy fields this config sets explicitly (applied over the stored policy)."""
        overrides: dict[str, Any] = {}
        if self.stage_capacity is not None:
            if len(self.stage_capacity) == 1:
                overrides["stage_capacity"] = self.stage_capacity * num_stages
            elif len(self.stage_capacity) == num_stages:
                overrides["stage_capacity"] = list(self.stage_capacity)
            else:
                raise ConfigError(
                    f"--stage-capacity has {len(self.stage_capacity)} values but the run has {num_stages} "
                    f"stages; give one value for all stages or one per stage"
                )
            overrides["stage_target"] = None
        if self.trainer_capacity is not None:
            overrides["trainer_capacity"] = self.trainer_capacity
        if self.join_rate_per_s is not None:
            overrides["join_rate_per_s"] = self.join_rate_per_s
        if self.join_burst is not None:
            overrides["join_burst"] = self.join_burst
        if self.checks is not None:
            overrides["checks"] = {name: name in self.checks for name in CHECK_NAMES}
        return overrides
