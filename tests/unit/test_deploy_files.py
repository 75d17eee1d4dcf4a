"""The deployment files under deploy/ are valid for the tools that read them: promtool checks the
alert rules and runs their unit tests, and checks the Prometheus config; systemd-analyze verifies
the units (where systemd is there); the example environment files name only real settings."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMETHEUS_DIR = os.path.join(ROOT, "deploy", "prometheus")
SYSTEMD_DIR = os.path.join(ROOT, "deploy", "systemd")
ROLES = ("worker", "trainer", "authorizer", "monitor")
METRIC = re.compile(r"\b(agora_[a-z_]+)")

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool is not installed (scripts/setup: apt-get install prometheus)")


def promtool(*args: str, cwd: str = PROMETHEUS_DIR) -> str:
    result = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


@needs_promtool
def test_promtool_checks_the_alert_rules():
    assert "SUCCESS" in promtool("check", "rules", "alerts.yml")


@needs_promtool
def test_promtool_runs_the_alert_rules_unit_tests():
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


def test_every_alert_has_a_unit_test():
    import yaml

    with open(os.path.join(PROMETHEUS_DIR, "alerts.yml")) as f:
        alerts = {rule["alert"] for group in yaml.safe_load(f)["groups"] for rule in group["rules"] if "alert" in rule}
    with open(os.path.join(PROMETHEUS_DIR, "alerts_test.yml")) as f:
        tested = {case["alertname"] for test in yaml.safe_load(f)["tests"] for case in test["alert_rule_test"]
                  if case["exp_alerts"]}
    assert alerts - tested == set(), "alerts that never fire in alerts_test.yml"
    assert len(alerts) >= 10


def test_rules_use_only_metrics_that_exist():
    """A renamed metric must not silently turn an alert off. The names are the catalogue's (the
    node's, the health monitor's, the push front's); histogram series add _bucket/_sum/_count."""
    catalogue = {
        "agora_node_info", "agora_node_ready", "agora_process_resident_memory_bytes", "agora_host_memory_total_bytes",
        "agora_device_memory_used_bytes", "agora_device_memory_total_bytes", "agora_auth_rejections_total",
        "agora_credential_expiry_timestamp_seconds", "agora_worker_stage_step", "agora_averaging_rounds_total",
        "agora_trainer_loss", "agora_trainer_tokens_total", "agora_metrics_pushes_total",
        "agora_monitor_stage_replicas", "agora_monitor_stage_min_replicas", "agora_monitor_alerts_active",
        "agora_metrics_push_front_total",
    }
    import yaml

    with open(os.path.join(PROMETHEUS_DIR, "alerts.yml")) as f:
        rules = [rule for group in yaml.safe_load(f)["groups"] for rule in group["rules"]]
    used = {name for rule in rules for name in METRIC.findall(rule["expr"])}
    assert used - catalogue == set()


@needs_promtool
def test_promtool_checks_the_prometheus_config(tmp_path):
    # file_sd globs that match nothing are only a warning; the rule file resolves next to the config
    for name in ("prometheus.yml", "alerts.yml"):
        shutil.copy(os.path.join(PROMETHEUS_DIR, name), tmp_path / name)
    output = promtool("check", "config", "prometheus.yml", cwd=str(tmp_path))
    assert "is valid prometheus config file syntax" in output and "1 rule files found" in output


def test_pushgateway_is_scraped_with_honor_labels():
    import yaml

    with open(os.path.join(PROMETHEUS_DIR, "prometheus.yml")) as f:
        jobs = {job["job_name"]: job for job in yaml.safe_load(f)["scrape_configs"]}
    assert jobs["pushgateway"]["honor_labels"] is True
    assert {"agora-node", "agora-authorizer", "pushgateway"} <= set(jobs)


def _unit(role: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # systemd keys are case-sensitive
    with open(os.path.join(SYSTEMD_DIR, f"agora-{role}.service")) as f:
        parser.read_file(f)
    return parser


@pytest.mark.parametrize("role", ROLES)
def test_unit_files_are_hardened_and_restart_on_failure(role):
    unit = _unit(role)
    service = unit["Service"]
    assert service["ExecStart"].split()[:3] == ["/opt/agora/venv/bin/agora-node", "--role", role]
    assert service["EnvironmentFile"] == f"/etc/agora/{role}.env"
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) >= 30
    assert service["User"] == "agora" and service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict" and service["StateDirectory"] == f"agora/{role}"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert os.path.exists(os.path.join(SYSTEMD_DIR, f"{role}.env.example"))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_units(tmp_path):
    # verify insists that ExecStart exists: point it at this checkout's agora-node
    agora_node = shutil.which("agora-node") or os.path.join(ROOT, ".venv", "bin", "agora-node")
    if not os.path.exists(agora_node):
        pytest.skip("agora-node is not installed in this environment")
    paths = []
    for role in ROLES:
        with open(os.path.join(SYSTEMD_DIR, f"agora-{role}.service")) as f:
            text = f.read().replace("/opt/agora/venv/bin/agora-node", agora_node)
        path = tmp_path / f"agora-{role}.service"
        path.write_text(text)
        paths.append(str(path))
    result = subprocess.run(["systemd-analyze", "verify", *paths], capture_output=True, text=True, timeout=120)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if "agora-" in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def _env(role: str) -> dict[str, str]:
    values = {}
    with open(os.path.join(SYSTEMD_DIR, f"{role}.env.example")) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, value = line.partition("=")
                values[name] = value
    return values


@pytest.mark.parametrize("role", ["worker", "trainer"])
def test_node_env_examples_name_real_settings(role):
    from node.settings import COMMON_FIELDS, ROLE_SECTIONS, build_settings

    env = _env(role)
    known = {f"AGORA_{name.upper()}" for name in set(COMMON_FIELDS) | set(ROLE_SECTIONS[role].model_fields)}
    assert set(env) - known == set(), "variables agora-node would ignore"
    settings = build_settings({"role": role}, environ=env)
    assert settings.metrics_push and settings.identity.startswith(f"/var/lib/agora/{role}/")


def test_authorizer_env_example_parses():
    from node.authorizer_cli import authorizer_parser

    args = authorizer_parser().parse_args(shlex.split(_env("authorizer")["AGORA_ARGS"]))
    assert args.pushgateway.startswith("http://127.0.0.1:")


def test_monitor_env_example_names_real_flags():
    result = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "-m", "node.cli", "--role", "monitor",
                             "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    if result.returncode != 0:
        pytest.skip(f"agora-node --role monitor --help is not available here: {result.stderr[-300:]}")
    flags = [word for word in shlex.split(_env("monitor")["AGORA_ARGS"]) if word.startswith("--")]
    assert flags and all(flag in result.stdout for flag in flags), result.stdout
