"""The standalone health monitor's settings (`agora-node --role monitor`); its flags are generated
from this model (node/monitor_cli.py). Inside the authorizer the monitor takes its settings from
the authorizer's own (authorizer/config.py: --no-monitor, --monitor-interval-s,
--monitor-host-maddrs, --alert-webhook)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"


class MonitorConfig(BaseModel):
    """Everything one standalone monitor process needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    authorizer: list[str] = Field(min_length=1, json_schema_extra={"metavar": "URL"},
                                  description="URL(s) of the run's authorizer(s); the monitor is admitted like a node")
    account_token: SecretStr = Field(json_schema_extra={"metavar": "ADMIN_TOKEN"},
                                     description="the run owner's admin token (admin.token in the authorizer's data "
                                                 "directory): only the owner may run a monitor")
    db: str = Field(json_schema_extra={"metavar": "URL"},
                    description="where the history goes: the authorizer's database (postgresql://..., so its "
                                "/v1/monitor API and dashboard show it) or sqlite:///path")
    identity: Optional[str] = Field(default=None, json_schema_extra={"metavar": "PATH"},
                                    description="libp2p key file, created if missing; keeps the monitor's peer id "
                                                "across restarts")
    interval_s: float = Field(default=10.0, ge=0.5, le=3600.0, description="how often the monitor reads the DHT "
                              "and records what it saw")
    alert_webhook: Optional[str] = Field(default=None, json_schema_extra={"metavar": "URL"},
                                         description="POST each new or resolved alert as JSON to this URL")
    initial_peers: list[str] = Field(default_factory=list, json_schema_extra={"metavar": "MADDR"},
                                     description="multiaddrs of peers in the run, besides those the authorizer gives")
    host_maddrs: list[str] = Field(default_factory=lambda: [LOOPBACK_MADDR], json_schema_extra={"metavar": "MADDR"},
                                   description="where the monitor's DHT node listens")
    announce_maddrs: list[str] = Field(default_factory=list, json_schema_extra={"metavar": "MADDR"},
                                       description="addresses to advertise, if not the listen addresses")
    admission_timeout_s: float = Field(default=300.0, gt=0, description="give up joining when no authorizer "
                                       "answered for this long")
    revocation_refresh_s: float = Field(default=30.0, gt=0, description="how often the revocation list is re-read")
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log verbosity")
    log_format: Literal["human", "json"] = Field(default="human", description="stderr log lines for people or one "
                                                 "JSON object per line")

    @field_validator("authorizer", mode="before")
    @classmethod
    def _urls(cls, values: Any) -> Any:
        if isinstance(values, str):
            values = values.replace(",", " ").split()
        return values

    @field_validator("alert_webhook")
    @classmethod
    def _webhook(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} is not an http(s) URL; e.g. http://alerts.example:9000/hook")
        return value

    def db_url(self) -> str:
        """The SQLAlchemy URL; plain postgresql:// is mapped to the psycopg 3 driver."""
        from protocol.errors import ConfigError

        for prefix in ("postgresql://", "postgres://"):
            if self.db.startswith(prefix):
                return "postgresql+psycopg://" + self.db[len(prefix):]
        if self.db.startswith(("sqlite:///", "postgresql+psycopg://")):
            return self.db
        raise ConfigError(f"--db {self.db!r} is not supported; use postgresql://user@host/db (the authorizer's "
                          f"database) or sqlite:///path/to/monitor.db")
