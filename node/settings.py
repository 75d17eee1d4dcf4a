"""Node settings: one pydantic model, a section per role, and three sources merged in order.

Flags override `AGORA_*` environment variables, which override the config file's optional
`node:` section, which overrides the defaults written on the fields. The same model generates
the command line (node/flags.py), so a setting is declared exactly once: those the node shares
with the relay and the monitor (admission, DHT, metrics port, logging) in `roles/settings_base.py`,
the other common settings here, the worker's in `roles/worker/config.py`, the trainer's in `roles/trainer/config.py`, the
authorizer's in `authorizer/config.py`. Roles receive their own section.
"""

from __future__ import annotations

import os
import typing
from typing import Any, Literal, Optional
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from protocol.errors import ConfigError
from roles.settings_base import (  # noqa: F401 (parse_authorizer_url: re-exported)
    AdmissionSettings, DHTSettings, LoggingSettings, MetricsPortSettings, parse_authorizer_url,
)
from roles.trainer.config import TrainerConfig
from roles.worker.config import WorkerConfig

ROLE_SECTIONS: dict[str, type[BaseModel]] = {"worker": WorkerConfig, "trainer": TrainerConfig}


class NodeSettings(MetricsPortSettings, LoggingSettings, DHTSettings, AdmissionSettings):
    """Everything one worker or trainer process needs besides the run config itself; the settings
    it shares with the relay and the monitor come from roles/settings_base.py."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["worker", "trainer"] = Field(description="what this node does in the run")
    config: Optional[str] = Field(default=None, description="run config: a preset (tiny, 1b, 8b) or a YAML path; "
                                  "with --authorizer the run's own config is used")
    insecure_open_run: bool = Field(default=False, description="run without an authorizer: any peer is trusted "
                                    "(local experiments only)")
    relay: str = Field(default="auto", description="how peers reach this node when they cannot dial it: auto (through "
                       "the run's relays, only if the authorizer cannot dial it back), off (never: an unreachable "
                       "node is refused), or a relay's multiaddr ending in /p2p/<id> (always through that relay)")
    relay_slot_timeout_s: float = Field(default=60.0, gt=0, description="how long a node reached through relays "
                                        "waits for a slot on one before it gives up joining")
    bootstrap_timeout_s: float = Field(default=30.0, gt=0, description="how long to try reaching the initial peers")
    torch_threads: Optional[int] = Field(default=None, ge=1, description="intra-op threads for torch compute")
    serve_nice: int = Field(default=0, ge=0, le=19, description="CPU priority (nice value, up to 19) a worker or "
                            "trainer lowers itself to once it serves (0: keep the one it was started at): the "
                            "host's own programs, and nodes starting beside it, get the CPU first")
    metrics_push: Optional[str] = Field(default=None, description="push metrics to this URL instead of being "
                                        "scraped: the run's push front (http://authorizer:8000/v1/metrics/push) "
                                        "or, in an open run, a Prometheus Pushgateway")
    metrics_push_interval_s: float = Field(default=15.0, ge=1.0, le=3600.0, description="how often metrics "
                                           "are pushed with --metrics-push")
    worker: WorkerConfig = Field(default_factory=WorkerConfig, description="the worker's section")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the trainer's section")

    @field_validator("relay")
    @classmethod
    def _relay_mode(cls, value: str) -> str:
        from protocol.relays import peer_of

        value = value.strip()
        if value in ("auto", "off"):
            return value
        if not value.startswith("/") or peer_of(value) is None:
            raise ValueError(f"{value!r} is neither auto, off nor a relay's multiaddr; give e.g. "
                             f"/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW...")
        return value

    @field_validator("metrics_push")
    @classmethod
    def _push_url(cls, value: Optional[str]) -> Optional[str]:
        if value is None:
            return None
        parts = urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL; e.g. http://203.0.113.7:8000/v1/metrics/push")
        return value.strip().rstrip("/")

    @property
    def section(self) -> BaseModel:
        """This node's role section: `worker` or `trainer`."""
        return getattr(self, self.role)


COMMON_FIELDS = frozenset(n for n in NodeSettings.model_fields if n not in ROLE_SECTIONS)


def setting_owners(name: str) -> list[str]:
    """Where a setting lives: 'node' for common settings, else the roles whose section has it."""
    if name in COMMON_FIELDS:
        return ["node"]
    return [role for role, model in ROLE_SECTIONS.items() if name in model.model_fields]


def _field(name: str):
    if name in COMMON_FIELDS:
        return NodeSettings.model_fields[name]
    for model in ROLE_SECTIONS.values():
        if name in model.model_fields:
            return model.model_fields[name]
    return None


def _is_list(annotation) -> bool:
    return typing.get_origin(annotation) is list


def _is_bool(annotation) -> bool:
    return annotation is bool


def _from_env(environ: dict[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    names = set(COMMON_FIELDS).union(*(m.model_fields for m in ROLE_SECTIONS.values()))
    for name in names:
        raw = environ.get(f"AGORA_{name.upper()}")
        if raw is None or raw == "":
            continue
        annotation = _field(name).annotation
        if _is_list(annotation):
            values[name] = [item for item in raw.replace(",", " ").split() if item]
        elif _is_bool(annotation):
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
    unknown = sorted(k for k in section if _field(str(k)) is None)
    if unknown:
        raise ConfigError(f"config {config}: unknown setting(s) in the 'node' section: {', '.join(map(str, unknown))}")
    return section


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def build_settings(flags: dict[str, Any], environ: Optional[dict[str, str]] = None) -> NodeSettings:
    """Merge the three sources into one NodeSettings; the first problem becomes a one-line
    ConfigError naming the flag. A flag of another role's section is a mistake worth naming;
    the same key in the environment or a shared config file is simply not used."""
    environ = dict(os.environ) if environ is None else environ
    env_values = _from_env(environ)
    flag_values = {k: v for k, v in flags.items() if v is not None and v != [] and v is not False}
    config = flag_values.get("config") or env_values.get("config")
    merged = {**_from_config_file(config), **env_values, **flag_values}
    role = merged.get("role")
    if role not in ROLE_SECTIONS:
        raise ConfigError("--role is required: worker, trainer or authorizer" if role is None else
                          f"--role {role!r} is not a role; choose worker, trainer or authorizer")
    if not merged.get("config") and not merged.get("authorizer"):
        raise ConfigError("--config is required (or --authorizer, which provides the run's config)")
    for name in flag_values:
        owners = setting_owners(name)
        if owners and "node" not in owners and role not in owners:
            raise ConfigError(f"{_flag(name)} is a {' and '.join(owners)} setting; this node is a {role}")
    common = {k: v for k, v in merged.items() if k in COMMON_FIELDS}
    section = {k: v for k, v in merged.items() if k in ROLE_SECTIONS[role].model_fields}
    try:
        return NodeSettings.model_validate({**common, role: section})
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(p) for p in error["loc"] if str(p) not in ROLE_SECTIONS]
        flag = _flag(loc[0]) if loc else "settings"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "missing":
            raise ConfigError(f"{flag} is required") from None
        got = "" if error["type"] == "value_error" else f" (got {error.get('input')!r})"
        raise ConfigError(f"{flag}: {message}{got}") from None
