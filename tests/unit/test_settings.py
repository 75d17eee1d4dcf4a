"""Node settings precedence: flags over AGORA_* environment over the config file's `node:` section."""

from __future__ import annotations

import pytest
import yaml

from node.settings import build_settings
from protocol.errors import ConfigError
from roles.model.config import dump_run_config, load_run_config


@pytest.fixture
def config_with_node_section(tmp_path):
    path = tmp_path / "run.yaml"
    dump_run_config(load_run_config("tiny"), path)
    document = yaml.safe_load(path.read_text())
    document["node"] = {"max_batch": 4, "lanes": 3}
    path.write_text(yaml.safe_dump(document))
    return str(path)


def test_file_then_environment_then_flags(config_with_node_section):
    base = {"role": "trainer", "config": config_with_node_section}
    assert build_settings(base, {}).max_batch == 4
    assert build_settings(base, {}).lanes == 3
    assert build_settings(base, {"AGORA_MAX_BATCH": "6"}).max_batch == 6
    assert build_settings({**base, "max_batch": 9}, {"AGORA_MAX_BATCH": "6"}).max_batch == 9
    assert load_run_config(config_with_node_section).run_id == "tiny"  # the run config ignores `node:`


def test_list_and_bool_variables_parse():
    settings = build_settings({"role": "trainer", "config": "tiny"}, {
        "AGORA_HOST_MADDRS": "/ip4/127.0.0.1/tcp/0, /ip4/127.0.0.1/tcp/1", "AGORA_INSECURE_OPEN_RUN": "yes"})
    assert settings.host_maddrs == ["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/tcp/1"]
    assert settings.insecure_open_run is True


def test_bad_node_section_is_a_config_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("node: [1, 2]\n")
    with pytest.raises(ConfigError, match="node"):
        build_settings({"role": "trainer", "config": str(path)}, {})
