"""Node settings: one model with a section per role, merged from flags over AGORA_* environment
over the config file's `node:` section; every mistake is one ConfigError naming the flag."""

from __future__ import annotations

import pytest
import yaml

from node.cli import node_parser
from node.settings import COMMON_FIELDS, ROLE_SECTIONS, build_settings, parse_authorizer_url
from protocol.errors import ConfigError
from protocol.run_config import dump_run_config, load_run_config
from roles.worker.config import parse_size


@pytest.fixture
def config_with_node_section(tmp_path):
    path = tmp_path / "run.yaml"
    dump_run_config(load_run_config("tiny"), path)
    document = yaml.safe_load(path.read_text())
    document["node"] = {"max_batch": 4, "lanes": 3}
    path.write_text(yaml.safe_dump(document))
    return str(path)


def test_file_then_environment_then_flags(config_with_node_section):
    worker = {"role": "worker", "config": config_with_node_section}
    assert build_settings(worker, {}).worker.max_batch == 4
    assert build_settings(worker, {"AGORA_MAX_BATCH": "6"}).worker.max_batch == 6
    assert build_settings({**worker, "max_batch": 9}, {"AGORA_MAX_BATCH": "6"}).worker.max_batch == 9
    assert build_settings({"role": "trainer", "config": config_with_node_section}, {}).trainer.lanes == 3
    assert load_run_config(config_with_node_section).run_id == "tiny"  # the run config ignores `node:`


def test_a_role_receives_only_its_section():
    settings = build_settings({"role": "trainer", "config": "tiny", "lanes": 7}, {"AGORA_MAX_BATCH": "3"})
    assert settings.section is settings.trainer and settings.trainer.lanes == 7
    assert settings.worker.max_batch is None  # the worker's key in a shared environment is not used (None: sized at start)


def test_a_flag_of_another_role_is_named():
    with pytest.raises(ConfigError, match="--lanes is a trainer setting; this node is a worker"):
        build_settings({"role": "worker", "config": "tiny", "lanes": 4}, {})


def test_list_and_bool_variables_parse():
    settings = build_settings({"role": "trainer", "config": "tiny"}, {
        "AGORA_HOST_MADDRS": "/ip4/127.0.0.1/tcp/0, /ip4/127.0.0.1/tcp/1", "AGORA_INSECURE_OPEN_RUN": "yes"})
    assert settings.host_maddrs == ["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/tcp/1"]
    assert settings.insecure_open_run is True


def test_no_setting_is_a_test_hook():
    """Faults are injected from tests/support/faults.py; the shipped settings hold none."""
    for model in ROLE_SECTIONS.values():
        assert not [name for name in model.model_fields if name.startswith("test_")]
    with pytest.raises(ConfigError, match="unrecognized arguments"):
        node_parser().parse_args(["--test-init-seed-offset", "2"])


def test_every_setting_is_a_flag():
    options = {a.dest for a in node_parser()._actions}
    for name in COMMON_FIELDS:
        assert name in options
    for model in ROLE_SECTIONS.values():
        for name in model.model_fields:
            assert name in options, name


def test_bad_node_section_is_a_config_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("node: [1, 2]\n")
    with pytest.raises(ConfigError, match="node"):
        build_settings({"role": "trainer", "config": str(path)}, {})


def test_unknown_key_in_node_section_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("node: {max_btach: 4}\n")
    with pytest.raises(ConfigError, match="max_btach"):
        build_settings({"role": "worker", "config": str(path)}, {})


@pytest.mark.parametrize("url, fragment", [
    ("127.0.0.1:8000", "has no scheme; write it as a URL, e.g. http://127.0.0.1:8000"),
    ("ftp://host:21", "uses ftp://"),
    ("http://:8000", "names no host"),
    ("http://host:99999", "bad port"),
    ("http://host:8000?x=1", "query or fragment"),
])
def test_malformed_authorizer_urls(url, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_authorizer_url(url)
    with pytest.raises(ConfigError, match="--authorizer"):
        build_settings({"role": "trainer", "authorizer": [url]}, {})


def test_several_authorizers():
    settings = build_settings({"role": "trainer"}, {"AGORA_AUTHORIZER": "http://a:8000/ https://b"})
    assert settings.authorizer == ["http://a:8000", "https://b"]


def test_sizes():
    assert parse_size("24GiB") == 24 * 2**30 and parse_size("24GB") == 24 * 10**9
    assert parse_size("16000MiB") == 16000 * 2**20 and parse_size("1.5 gib") == int(1.5 * 2**30)
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    assert build_settings({"role": "worker", "config": "tiny", "gpu_memory": "24GiB"}, {}).worker.gpu_memory == 24 * 2**30


def test_version_and_help_groups(capsys):
    parser = node_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--version"])
    assert capsys.readouterr().out.startswith("agora-node ")
    groups = [group.title for group in parser._action_groups]
    assert {"every node", "worker", "trainer", "worker and trainer"} <= set(groups)
    assert "exit codes:" in parser.format_help() and "130" in parser.format_help()
