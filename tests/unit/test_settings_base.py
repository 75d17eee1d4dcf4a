"""The node, the relay and the standalone monitor share their admission, DHT, metrics-port and
logging settings through roles/settings_base.py: one field, one validator, one flag, and each
CLI keeps every flag it had."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, SecretStr

from authorizer.config import AuthorizerConfig
from authorizer.monitor.config import MonitorConfig
from node.cli import node_parser
from node.monitor_cli import config_from_args as monitor_config, monitor_parser
from node.relay_cli import config_from_args as relay_config, relay_parser
from node.settings import COMMON_FIELDS, NodeSettings, build_settings
from protocol.errors import ConfigError
from roles.relay.config import DEFAULT_RELAY_MADDR, RelayConfig
from roles.settings_base import (
    AdmissionSettings, DHTSettings, LoggingSettings, MetricsPortSettings, check_multiaddrs,
)

BASES: dict[type[BaseModel], tuple[type[BaseModel], ...]] = {
    NodeSettings: (AdmissionSettings, DHTSettings, LoggingSettings, MetricsPortSettings),
    RelayConfig: (AdmissionSettings, LoggingSettings, MetricsPortSettings),
    MonitorConfig: (AdmissionSettings, DHTSettings, LoggingSettings),
    AuthorizerConfig: (LoggingSettings,),
}
OVERRIDES = {  # (model, field): what the role changes, and nothing else (role_field)
    (RelayConfig, "authorizer"): {"default", "default_factory", "metadata"},
    (RelayConfig, "account_token"): {"default", "description", "json_schema_extra"},
    (RelayConfig, "host_maddrs"): {"default_factory", "description"},
    (MonitorConfig, "authorizer"): {"default", "default_factory", "metadata"},
    (MonitorConfig, "account_token"): {"default", "description", "json_schema_extra"},
}
ATTRIBUTES = ("annotation", "default", "default_factory", "description", "metadata", "json_schema_extra")

ADMIN = ["--authorizer", "http://127.0.0.1:8000", "--account-token", "admin-secret"]
MADDR = "/ip4/127.0.0.1/tcp/4001"


@pytest.mark.parametrize("model", list(BASES), ids=lambda m: m.__name__)
def test_each_role_takes_the_shared_fields_from_the_base(model):
    for base in BASES[model]:
        assert issubclass(model, base)
        for name, shared in base.model_fields.items():
            field = model.model_fields[name]
            assert field.annotation == shared.annotation, (model.__name__, name)
            differ = {a for a in ATTRIBUTES if getattr(field, a) != getattr(shared, a)}
            assert differ <= OVERRIDES.get((model, name), set()), (model.__name__, name, differ)
            assert set(shared.metadata) <= set(field.metadata), (model.__name__, name)


def test_no_setting_is_declared_twice_between_node_relay_and_monitor():
    base = {n for b in (AdmissionSettings, DHTSettings, LoggingSettings, MetricsPortSettings) for n in b.model_fields}
    node, relay, monitor = set(COMMON_FIELDS), set(RelayConfig.model_fields), set(MonitorConfig.model_fields)
    assert (node & relay) | (node & monitor) | (relay & monitor) <= base


def test_a_role_keeps_the_base_validators_on_a_field_it_redeclares():
    with pytest.raises(ValueError, match="no scheme"):
        RelayConfig(authorizer=["127.0.0.1:8000"], account_token="t")
    with pytest.raises(ValueError, match="not a multiaddr"):
        RelayConfig(authorizer=["http://a:8000"], account_token="t", host_maddrs=["0.0.0.0:4001"])
    with pytest.raises(ValueError, match="at least 1 item"):
        MonitorConfig(authorizer=[], account_token="t", db="sqlite:///m.db")
    relay = RelayConfig(authorizer="http://a:8000/, http://b:8000", account_token="t")
    assert relay.authorizer == ["http://a:8000", "http://b:8000"] and relay.host_maddrs == [DEFAULT_RELAY_MADDR]


@pytest.mark.parametrize("flag", ["--initial-peers", "--host-maddrs", "--announce-maddrs"])
def test_the_monitor_rejects_a_bad_multiaddr_like_the_node(flag):
    with pytest.raises(ValueError) as expected:
        check_multiaddrs(["127.0.0.1:4001"])
    argv = [*ADMIN, "--db", "sqlite:///m.db", flag, "127.0.0.1:4001"]
    with pytest.raises(ConfigError) as monitor:
        monitor_config(monitor_parser().parse_args(argv))
    with pytest.raises(ConfigError) as node:
        build_settings(vars(node_parser().parse_args(["--role", "worker", "--config", "tiny", flag, "127.0.0.1:4001"])),
                       {})
    assert str(monitor.value) == str(node.value) == f"{flag}: {expected.value}"


def test_the_monitor_and_relay_reject_a_bad_authorizer_url_at_once():
    for parse, parser, rest in ((monitor_config, monitor_parser, ["--db", "sqlite:///m.db"]),
                                (relay_config, relay_parser, [])):
        with pytest.raises(ConfigError, match="--authorizer: '127.0.0.1:8000' has no scheme"):
            parse(parser().parse_args(["--authorizer", "127.0.0.1:8000", "--account-token", "t", *rest]))


SHARED_ARGS = ["--identity", "/tmp/key", "--host-maddrs", MADDR, "--announce-maddrs", MADDR,
               "--admission-timeout-s", "12", "--revocation-refresh-s", "7", "--log-level", "debug",
               "--log-format", "json"]


def _shared_values_landed(config) -> None:
    assert config.authorizer == ["http://127.0.0.1:8000"] and config.identity == "/tmp/key"
    assert config.host_maddrs == [MADDR] and config.announce_maddrs == [MADDR]
    assert config.admission_timeout_s == 12 and config.revocation_refresh_s == 7
    assert (config.log_level, config.log_format) == ("debug", "json")


def test_the_relay_accepts_its_old_flags():
    argv = [*ADMIN, *SHARED_ARGS, "--max-reservations", "3", "--max-circuits-per-peer", "2", "--circuit-max-bytes",
            str(2 << 20), "--circuit-max-duration-s", "120", "--buffer-bytes", str(1 << 20), "--pass-grace-s", "2",
            "--metrics-port", "0", "--metrics-host", "0.0.0.0"]
    config = relay_config(relay_parser().parse_args(argv))
    _shared_values_landed(config)
    assert config.account_token == SecretStr("admin-secret") and config.account_token.get_secret_value() == "admin-secret"
    assert (config.max_reservations, config.pass_grace_s, config.metrics_port, config.metrics_host) == (3, 2, 0, "0.0.0.0")
    with pytest.raises(ConfigError, match="--account-token is required"):
        relay_config(relay_parser().parse_args(["--authorizer", "http://127.0.0.1:8000"]))


def test_the_monitor_accepts_its_old_flags():
    argv = [*ADMIN, *SHARED_ARGS, "--db", "sqlite:///m.db", "--interval-s", "2", "--alert-webhook",
            "http://127.0.0.1:9/hook", "--initial-peers", MADDR]
    config = monitor_config(monitor_parser().parse_args(argv))
    _shared_values_landed(config)
    assert config.account_token.get_secret_value() == "admin-secret" and config.initial_peers == [MADDR]
    assert (config.db, config.interval_s, config.alert_webhook) == ("sqlite:///m.db", 2, "http://127.0.0.1:9/hook")
    with pytest.raises(ConfigError, match="--authorizer is required"):
        monitor_config(monitor_parser().parse_args(["--account-token", "t", "--db", "sqlite:///m.db"]))


def test_the_node_accepts_its_old_flags_variables_and_keys(tmp_path):
    argv = ["--role", "trainer", "--config", "tiny", *ADMIN[:2], "--account-token", "s3cr3t-tok", *SHARED_ARGS,
            "--initial-peers", MADDR, "--metrics-port", "0", "--metrics-host", "0.0.0.0"]
    settings = build_settings(vars(node_parser().parse_args(argv)), {})
    _shared_values_landed(settings)
    assert settings.account_token.get_secret_value() == "s3cr3t-tok" and "s3cr3t" not in repr(settings)
    assert (settings.initial_peers, settings.metrics_port, settings.metrics_host) == ([MADDR], 0, "0.0.0.0")
    environ = {"AGORA_ACCOUNT_TOKEN": "env-tok", "AGORA_AUTHORIZER": "http://a:8000", "AGORA_LOG_FORMAT": "json",
               "AGORA_ANNOUNCE_MADDRS": MADDR}
    settings = build_settings({"role": "worker"}, environ)
    assert settings.account_token.get_secret_value() == "env-tok" and settings.authorizer == ["http://a:8000"]
    assert settings.log_format == "json" and settings.announce_maddrs == [MADDR]
    path = tmp_path / "run.yaml"
    path.write_text(f"node: {{account_token: file-tok, identity: /tmp/k, initial_peers: ['{MADDR}']}}\n")
    settings = build_settings({"role": "worker", "config": str(path)}, {})
    assert settings.account_token.get_secret_value() == "file-tok" and settings.initial_peers == [MADDR]


def test_help_shows_no_default_for_a_secret():
    for parser in (node_parser(), relay_parser(), monitor_parser()):
        text = parser.format_help()
        assert "--account-token" in text and "(default: **" not in text and "(default: )" not in text


def test_the_authorizer_checks_its_monitors_addresses_as_multiaddrs():
    with pytest.raises(ValueError, match="not a multiaddr"):
        AuthorizerConfig(monitor_host_maddrs=["127.0.0.1:4001"])
    assert AuthorizerConfig(monitor_host_maddrs=[MADDR]).monitor_host_maddrs == [MADDR]
