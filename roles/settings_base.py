"""The settings every process that joins a run shares, declared once: how it is admitted
(`AdmissionSettings`), how it finds the run's DHT (`DHTSettings`), where it serves its metrics
(`MetricsPortSettings`) and how it logs (`LoggingSettings`).

The node (node/settings.py), the relay (roles/relay/config.py) and the standalone monitor
(authorizer/monitor/config.py) build their models from these, so a shared setting has one type,
one validator, one help text and one flag name (flags, `AGORA_*` variables and config keys are
derived from the field name). It lives in roles/ because the relay's config does and roles/ is the
lowest layer all three may import (tests/unit/test_layers.py).

A role that needs another default (or wording) for a shared field re-declares it with
`role_field`, which copies everything else from the base: the type, the constraints, the
validators (they follow the field name) and the metavar.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_core import PydanticUndefined

LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"


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


def check_multiaddrs(values: list[str]) -> list[str]:
    """`values` unchanged, or a ValueError naming the first that is not a multiaddr."""
    from hivemind.utils.multiaddr import Multiaddr

    for value in values:
        try:
            Multiaddr(value)
        except Exception as exc:
            raise ValueError(f"{value!r} is not a multiaddr; expected e.g. /ip4/127.0.0.1/tcp/31337/p2p/Qm...") from exc
    return values


def role_field(model: type[BaseModel], name: str, *, required: bool = False, **changes: Any) -> Any:
    """`model`'s field `name` with only `changes` replaced (`default` or `default_factory`,
    `description`, constraints such as `min_length`; `json_schema_extra` keys are merged), or
    without a default when `required`. Re-declare the field with the base's annotation:
    `x: T = role_field(Base, "x", ...)`; its validators follow the name."""
    field = model.model_fields[name]
    kwargs: dict[str, Any] = {"description": field.description}
    if field.default_factory is not None:
        kwargs["default_factory"] = field.default_factory
    elif field.default is not PydanticUndefined:
        kwargs["default"] = field.default
    for meta in field.metadata:  # the constraints (Gt, MinLen, ...): annotated-types dataclasses
        if not dataclasses.is_dataclass(meta):
            raise TypeError(f"role_field cannot copy {meta!r} of {model.__name__}.{name}")
        kwargs.update(dataclasses.asdict(meta))
    if required or "default" in changes or "default_factory" in changes:
        kwargs.pop("default", None)
        kwargs.pop("default_factory", None)
    extra = {**(field.json_schema_extra or {}), **changes.pop("json_schema_extra", {})}  # type: ignore[dict-item]
    return Field(**{**kwargs, **changes}, json_schema_extra=extra or None)


class LoggingSettings(BaseModel):
    """How a process logs (node/logs.py `setup_logging`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log verbosity")
    log_format: Literal["human", "json"] = Field(default="human", description="stderr log lines for people or one "
                                                 "JSON object per line")


class AdmissionSettings(BaseModel):
    """How a process is admitted to a run by its authorizer(s) and keeps its credential
    (node/trust.py `establish_trust`): the authorizer dials it back at its addresses."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    authorizer: list[str] = Field(default_factory=list, json_schema_extra={"metavar": "URL"},
                                  description="URL(s) of the run's authorizer(s), e.g. http://host:8000; several "
                                              "fail over to each other")
    account_token: SecretStr = Field(default=SecretStr(""), json_schema_extra={"metavar": "TOKEN"},
                                     description="account token the run owner gave you, if the run needs one")
    identity: Optional[str] = Field(default=None, json_schema_extra={"metavar": "PATH"},
                                    description="file holding the libp2p key, created if missing; keeps the peer id "
                                                "across restarts")
    host_maddrs: list[str] = Field(default_factory=lambda: [LOOPBACK_MADDR], json_schema_extra={"metavar": "MADDR"},
                                   description="where to listen")
    announce_maddrs: list[str] = Field(default_factory=list, json_schema_extra={"metavar": "MADDR"},
                                       description="addresses to advertise, if not the listen addresses (public "
                                                   "address, port forwarding)")
    admission_timeout_s: float = Field(default=300.0, gt=0, description="give up joining when no authorizer "
                                       "answered for this long")
    revocation_refresh_s: float = Field(default=30.0, gt=0, description="how often the revocation list is re-read")

    @field_validator("authorizer", mode="before")
    @classmethod
    def _authorizer_urls(cls, values: Any) -> list[str]:
        if isinstance(values, str):
            values = values.replace(",", " ").split()
        return list(dict.fromkeys(parse_authorizer_url(v) for v in values or []))

    @field_validator("host_maddrs", "announce_maddrs")
    @classmethod
    def _own_multiaddrs(cls, values: list[str]) -> list[str]:
        return check_multiaddrs(values)


class DHTSettings(BaseModel):
    """How a process that joins the run's DHT finds it (a relay joins none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    initial_peers: list[str] = Field(default_factory=list, json_schema_extra={"metavar": "MADDR"},
                                     description="multiaddrs of peers already in the run, besides those the "
                                                 "authorizer gives")

    # Validator names differ across these bases on purpose: pydantic keeps one validator per name
    # in a model, so a role built from two bases would silently lose one of two same-named ones.
    @field_validator("initial_peers")
    @classmethod
    def _initial_peers(cls, values: list[str]) -> list[str]:
        return check_multiaddrs(values)


class MetricsPortSettings(BaseModel):
    """Where a process serves its Prometheus metrics, if it does."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metrics_port: Optional[int] = Field(default=None, ge=0, le=65535, description="serve Prometheus /metrics (a "
                                        "worker or trainer also /healthz and /readyz) on this port (0: any free "
                                        "port); off by default")
    metrics_host: str = Field(default="127.0.0.1", max_length=255, description="address the metrics port listens "
                              "on; 0.0.0.0 lets a Prometheus on another machine scrape it")
