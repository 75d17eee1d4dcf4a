"""The standalone health monitor's settings (`agora-node --role monitor`); its flags are generated
from this model (node/monitor_cli.py). Inside the authorizer the monitor takes its settings from
the authorizer's own (authorizer/config.py: --no-monitor, --monitor-interval-s,
--monitor-host-maddrs, --alert-webhook)."""

from __future__ import annotations

from typing import Optional

from pydantic import ConfigDict, Field, SecretStr, field_validator

from roles.settings_base import AdmissionSettings, DHTSettings, LoggingSettings, role_field


class MonitorConfig(LoggingSettings, DHTSettings, AdmissionSettings):
    """Everything one standalone monitor process needs; what it shares with nodes and relays comes
    from roles/settings_base.py."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Only the run owner runs a monitor: the authorizer and the owner's admin token are required.
    authorizer: list[str] = role_field(AdmissionSettings, "authorizer", required=True, min_length=1)
    account_token: SecretStr = role_field(
        AdmissionSettings, "account_token", required=True, json_schema_extra={"metavar": "ADMIN_TOKEN"},
        description="the run owner's admin token (admin.token in the authorizer's data directory): only the owner "
                    "may run a monitor")
    db: str = Field(json_schema_extra={"metavar": "URL"},
                    description="where the history goes: the authorizer's database (postgresql://..., so its "
                                "/v1/monitor API and dashboard show it) or sqlite:///path")
    interval_s: float = Field(default=10.0, ge=0.5, le=3600.0, description="how often the monitor reads the DHT "
                              "and records what it saw")
    alert_webhook: Optional[str] = Field(default=None, json_schema_extra={"metavar": "URL"},
                                         description="POST each new or resolved alert as JSON to this URL")

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
