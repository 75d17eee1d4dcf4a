"""What a person (or a log shipper) reads on a node's stderr: one format for every line, whether
it came from our code, hivemind, its forked DHT process or p2pd; the JSON summary on stdout and a
human one on stderr."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.integration

RECORD = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO |WARN |ERROR|FATAL) worker  (\S+): ")
CONTINUATION = "    "
ISO_WITH_OFFSET = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d$")


def _run_worker(make_swarm, run_config_path, *args: str):
    swarm = make_swarm(run_config_path())
    worker = swarm.start("worker", stage=0, args=list(args))
    assert swarm.stop(worker) == 0, worker.log_tail()
    with open(worker.log_path) as f:
        return worker, f.read().splitlines()


@pytest.mark.timeout(90)
def test_every_stderr_line_is_in_the_human_format(make_swarm, run_config_path):
    # debug, so hivemind's lines (from this process and its forked DHT process) and p2pd's relayed
    # ones are there to check; at the default level they are quiet.
    worker, lines = _run_worker(make_swarm, run_config_path, "--log-level", "debug")
    assert lines and RECORD.match(lines[0]), lines[:3]
    loggers = set()
    for line in lines:
        match = RECORD.match(line)
        assert match or line.startswith(CONTINUATION), f"not in the log format: {line!r}"
        if match:
            loggers.add(match.group(2))
    assert any(name.startswith("hivemind.") for name in loggers), loggers
    assert "p2pd" in loggers and "node" in loggers, loggers
    assert any("worker of stage 0 done" in line for line in lines)  # the human summary
    assert worker.summary() is not None and "local_step" in worker.summary()  # the JSON one, on stdout


@pytest.mark.timeout(90)
def test_json_format_gives_one_object_per_line(make_swarm, run_config_path):
    worker, lines = _run_worker(make_swarm, run_config_path, "--log-format", "json")
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON line: {line!r}")
    assert entries
    for entry in entries:
        assert {"ts", "level", "role", "logger", "message"} <= entry.keys(), entry
        assert ISO_WITH_OFFSET.match(entry["ts"]) and entry["role"] == "worker", entry
    assert any(e["message"].startswith("worker of stage 0 done") for e in entries)
    assert worker.summary() is not None
