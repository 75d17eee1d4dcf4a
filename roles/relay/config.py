"""A relay's settings (`agora-node --role relay`); its flags are generated from this model
(node/relay_cli.py). The limits go to p2pd's circuit-relay-v2 service; the pass grace to our gate."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

DEFAULT_RELAY_MADDR = "/ip4/0.0.0.0/tcp/4001"


class RelayConfig(BaseModel):
    """Everything one relay process needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    authorizer: list[str] = Field(min_length=1, json_schema_extra={"metavar": "URL"},
                                  description="URL(s) of the run's authorizer(s); the relay is admitted like a node "
                                              "and the authorizer lists it to every node it admits")
    account_token: SecretStr = Field(json_schema_extra={"metavar": "ADMIN_TOKEN"},
                                     description="the run owner's admin token (admin.token in the authorizer's data "
                                                 "directory): only the owner runs the run's relays")
    identity: Optional[str] = Field(default=None, json_schema_extra={"metavar": "PATH"},
                                    description="libp2p key file, created if missing; keeps the relay's peer id (and "
                                                "so the circuit addresses nodes announce) across restarts")
    host_maddrs: list[str] = Field(default_factory=lambda: [DEFAULT_RELAY_MADDR],
                                   json_schema_extra={"metavar": "MADDR"},
                                   description="where the relay listens: a public address and an open port")
    announce_maddrs: list[str] = Field(default_factory=list, json_schema_extra={"metavar": "MADDR"},
                                       description="addresses to advertise, if not the listen addresses")
    max_reservations: int = Field(default=128, ge=1, le=100_000,
                                  description="nodes behind NAT that may hold a slot on this relay at once")
    max_circuits_per_peer: int = Field(default=16, ge=1, le=10_000,
                                       description="relayed connections open at once to or from one node")
    circuit_max_bytes: int = Field(default=4 << 30, ge=1 << 20,
                                   description="bytes one relayed connection may carry each way before it is "
                                               "reset (the peers then open a new one)")
    circuit_max_duration_s: float = Field(default=3600.0, ge=60.0,
                                          description="how long one relayed connection may stay open")
    buffer_bytes: int = Field(default=2 << 20, ge=64 << 10, le=64 << 20,
                              description="buffer per relayed connection and direction: memory per circuit, and "
                                          "what one round trip can carry")
    pass_grace_s: float = Field(default=5.0, gt=0, le=120.0,
                                description="how long a peer may stay connected without showing a credential "
                                            "before the relay drops it (and its reservation)")
    metrics_port: Optional[int] = Field(default=None, ge=0, le=65535,
                                        description="serve Prometheus /metrics on this port; off by default")
    metrics_host: str = Field(default="127.0.0.1", max_length=255, description="address the metrics port listens on")
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

    @field_validator("host_maddrs", "announce_maddrs")
    @classmethod
    def _multiaddrs(cls, values: list[str]) -> list[str]:
        from hivemind.utils.multiaddr import Multiaddr

        for value in values:
            try:
                Multiaddr(value)
            except Exception:
                raise ValueError(f"{value!r} is not a multiaddr; expected e.g. /ip4/0.0.0.0/tcp/4001") from None
        return values

    def daemon_flags(self) -> dict:
        """p2pd's circuit-relay-v2 service with these limits, on whatever autonat thinks."""
        return {"relayService": True, "forceReachabilityPublic": True, "relayMaxReservations": self.max_reservations,
                "relayMaxCircuits": self.max_circuits_per_peer, "relayDataLimit": self.circuit_max_bytes,
                "relayTimeLimit": f"{int(self.circuit_max_duration_s)}s", "relayBufferSize": self.buffer_bytes}
