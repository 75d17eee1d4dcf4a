"""Node settings: one pydantic model, a section per role, and three sources merged in order.

Flags override `AGORA_*` environment variables, which override the config file's optional
`node:` section, which overrides the defaults written on the fields. The same model generates
the command line (node/flags.py), so a setting is declared exactly once: common settings here,
the worker's in `roles/worker/config.py`, the trainer's in `roles/trainer/config.py`, the
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
from roles.trainer.config import TrainerConfig
from roles.worker.config import WorkerConfig

LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"
ROLE_SECTIONS: dict[str, type[BaseModel]] = {"worker": WorkerConfig, "trainer": TrainerConfig}


def parse_authorizer_url(text: str) -> str:
    """`text` as a normalised authorizer base URL (`http://host:port[/prefix]`), or a ValueError
    with one sentence saying what is wrong: a typo fails at once instead of retrying a connection
    that can never work."""
    value = str(text).strip()
    if "://" not in value:
        raise ValueError(f"{value!r} has no scheme; write it as a URL, e.g. http://{value or 'host:8000'}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{value!r} uses {parts.scheme}://; the authorizer speaks http:// or https://")
    if not parts.hostname:
        raise ValueError(f"{value!r} names no host; e.g. http://203.0.113.7:8000")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{value!r} has a bad port; give a number 1-65535, e.g. "
                         f"{parts.scheme}://{parts.hostname}:8000") from None
    if port == 0:
        raise ValueError(f"{value!r} has port 0; give the port the authorizer serves on (default 8000)")
    if parts.query or parts.fragment:
        raise ValueError(f"{value!r} has a query or fragment; give only scheme, host, port and path")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


class NodeSettings(BaseModel):
    """Everything one worker or trainer process needs besides the run config itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["worker", "trainer"] = Field(description="what this node does in the run")
    config: Optional[str] = Field(default=None, description="run config: a preset (tiny, 1b, 8b) or a YAML path; "
                                  "with --authorizer the run's own config is used")
    authorizer: list[str] = Field(default_factory=list, description="URL(s) of the run's authorizer(s), e.g. "
                                  "http://host:8000; several fail over to each other")
    account_token: str = Field(default="", description="account token the run owner gave you, if the run needs one")
    admission_timeout_s: float = Field(default=300.0, gt=0, description="give up joining when no authorizer "
                                       "answered for this long")
    insecure_open_run: bool = Field(default=False, description="run without an authorizer: any peer is trusted "
                                    "(local experiments only)")
    revocation_refresh_s: float = Field(default=30.0, gt=0, description="how often the revocation list is re-read")
    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of peers already in the run")
    host_maddrs: list[str] = Field(default_factory=lambda: [LOOPBACK_MADDR], description="where to listen")
    announce_maddrs: list[str] = Field(default_factory=list, description="addresses to advertise, if not the "
                                       "listen addresses (public address, port forwarding)")
    relay: str = Field(default="auto", description="how peers reach this node when they cannot dial it: auto (through "
                       "the run's relays, only if the authorizer cannot dial it back), off (never: an unreachable "
                       "node is refused), or a relay's multiaddr ending in /p2p/<id> (always through that relay)")
    relay_slot_timeout_s: float = Field(default=60.0, gt=0, description="how long a node reached through relays "
                                        "waits for a slot on one before it gives up joining")
    identity: Optional[str] = Field(default=None, description="file holding the libp2p key, created if missing; "
                                    "keeps the peer id across restarts")
    bootstrap_timeout_s: float = Field(default=30.0, gt=0, description="how long to try reaching the initial peers")
    torch_threads: Optional[int] = Field(default=None, ge=1, description="intra-op threads for torch compute")
    serve_nice: int = Field(default=0, ge=0, le=19, description="CPU priority (nice value, up to 19) a worker or "
                            "trainer lowers itself to once it serves (0: keep the one it was started at): the "
                            "host's own programs, and nodes starting beside it, get the CPU first")
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log verbosity")
    log_format: Literal["human", "json"] = Field(default="human", description="stderr log lines for people or "
                                                 "one JSON object per line")
    metrics_port: Optional[int] = Field(default=None, ge=0, le=65535, description="serve Prometheus /metrics, "
                                        "/healthz and /readyz on this port (0: any free port); off by default")
    metrics_host: str = Field(default="127.0.0.1", max_length=255, description="address the metrics port listens "
                              "on; 0.0.0.0 lets a Prometheus on another machine scrape it")
    metrics_push: Optional[str] = Field(default=None, description="push metrics to this URL instead of being "
                                        "scraped: the run's push front (http://authorizer:8000/v1/metrics/push) "
                                        "or, in an open run, a Prometheus Pushgateway")
    metrics_push_interval_s: float = Field(default=15.0, ge=1.0, le=3600.0, description="how often metrics "
                                           "are pushed with --metrics-push")
    worker: WorkerConfig = Field(default_factory=WorkerConfig, description="the worker's section")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the trainer's section")

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

    @field_validator("authorizer", mode="before")
    @classmethod
    def _authorizer_urls(cls, values: Any) -> list[str]:
        if isinstance(values, str):
            values = values.replace(",", " ").split()
        return list(dict.fromkeys(parse_authorizer_url(v) for v in values or []))

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
