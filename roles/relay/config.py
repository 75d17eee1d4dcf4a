"""A relay's settings (`agora-node --role relay`); its flags are generated from this model
(node/relay_cli.py). The limits go to p2pd's circuit-relay-v2 service; the pass grace to our gate."""

from __future__ import annotations

from pydantic import ConfigDict, Field, SecretStr

from roles.settings_base import AdmissionSettings, LoggingSettings, MetricsPortSettings, role_field

DEFAULT_RELAY_MADDR = "/ip4/0.0.0.0/tcp/4001"


class RelayConfig(MetricsPortSettings, LoggingSettings, AdmissionSettings):
    """Everything one relay process needs; what it shares with nodes and the monitor comes from
    roles/settings_base.py. A relay joins no DHT, so it has no --initial-peers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Only the run owner runs relays: the authorizer and the owner's admin token are required.
    authorizer: list[str] = role_field(AdmissionSettings, "authorizer", required=True, min_length=1)
    account_token: SecretStr = role_field(
        AdmissionSettings, "account_token", required=True, json_schema_extra={"metavar": "ADMIN_TOKEN"},
        description="the run owner's admin token (admin.token in the authorizer's data directory): only the owner "
                    "runs the run's relays")
    # Nodes behind NAT dial a relay from anywhere at an address they are told once: it listens on
    # every interface at a fixed, well-known port instead of a node's loopback and any free port.
    host_maddrs: list[str] = role_field(AdmissionSettings, "host_maddrs", default_factory=lambda: [DEFAULT_RELAY_MADDR],
                                        description="where the relay listens: a public address and an open port")
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

    def daemon_flags(self) -> dict:
        """p2pd's circuit-relay-v2 service with these limits, on whatever autonat thinks."""
        return {"relayService": True, "forceReachabilityPublic": True, "relayMaxReservations": self.max_reservations,
                "relayMaxCircuits": self.max_circuits_per_peer, "relayDataLimit": self.circuit_max_bytes,
                "relayTimeLimit": f"{int(self.circuit_max_duration_s)}s", "relayBufferSize": self.buffer_bytes}
