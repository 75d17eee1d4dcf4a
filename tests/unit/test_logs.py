"""One log format for our loggers, hivemind's, p2pd's relayed lines and forked children."""

from __future__ import annotations

import datetime
import io
import json
import logging
import multiprocessing as mp
import os
import re
import subprocess
import sys

import pytest

from node.logs import HumanFormatter, JsonFormatter, setup_logging

HUMAN_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO |WARN |ERROR|FATAL) \S+ +\S+: ")
ISO_WITH_OFFSET = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d$")


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch):
    """setup_logging changes process-wide state; put it back so other tests see the default."""
    from hivemind.utils.logging import use_hivemind_log_handler

    monkeypatch.delenv("GOLOG_LOG_LEVEL", raising=False)
    monkeypatch.delenv("HIVEMIND_LOGLEVEL", raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in ("hivemind", "asyncio", "httpx", "uvicorn")}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, lvl in levels.items():
        logging.getLogger(name).setLevel(lvl)
    use_hivemind_log_handler("in_hivemind")
    logging.captureWarnings(False)


def _record(msg="hello %s", args=("world",), level=logging.INFO, name="roles.trainer.role", **extra):
    record = logging.LogRecord(name, level, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def test_human_line_has_time_level_role_short_logger_and_message():
    line = HumanFormatter("trainer").format(_record())
    assert HUMAN_LINE.match(line), line
    assert line.endswith(" INFO  trainer trainer.role: hello world")
    assert "\x1b[" not in line


def test_human_multiline_message_and_traceback_are_indented_under_their_record():
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("plan:\nline two", (), level=logging.ERROR, exc_info=sys.exc_info())
    lines = HumanFormatter("worker").format(record).split("\n")
    assert HUMAN_LINE.match(lines[0]) and lines[0].endswith("ERROR worker  trainer.role: plan:")
    assert len(lines) > 3 and all(line.startswith("    ") for line in lines[1:])
    assert "ValueError: boom" in lines[-1]


def test_colours_only_when_asked():
    plain = HumanFormatter("worker").format(_record(level=logging.WARNING))
    coloured = HumanFormatter("worker", colors=True).format(_record(level=logging.WARNING))
    assert "\x1b[" not in plain and "WARN " in plain
    assert "\x1b[" in coloured and "hello world" in coloured


def test_json_line_has_iso_time_with_offset_and_extra_fields():
    entry = json.loads(JsonFormatter("worker").format(_record(stage=3, peer=b"not json")))
    assert ISO_WITH_OFFSET.match(entry["ts"]), entry["ts"]
    assert entry["level"] == "info" and entry["role"] == "worker" and entry["logger"] == "trainer.role"
    assert entry["message"] == "hello world" and entry["stage"] == 3 and entry["peer"] == "b'not json'"


def test_json_line_carries_the_traceback():
    try:
        raise KeyError("k")
    except KeyError:
        entry = json.loads(JsonFormatter("worker").format(_record(level=logging.ERROR, exc_info=sys.exc_info())))
    assert "KeyError" in entry["exc"] and "\n" not in JsonFormatter("w").format(_record())


def test_short_names():
    from node.logs import short_name

    assert short_name(_record(name="agora.node")) == "node"
    assert short_name(_record(name="roles.worker.averaging.service")) == "worker.averaging.service"
    assert short_name(_record(name="hivemind.dht.routing")) == "hivemind.dht"
    assert short_name(_record(name="hivemind.p2p.p2p_daemon", caller="p2pd")) == "p2pd"
    assert short_name(_record(name="node.trust")) == "node.trust"


def test_hivemind_and_p2pd_lines_come_through_our_handler():
    from hivemind.p2p.p2p_daemon import P2P
    from hivemind.utils.logging import get_logger

    stream = io.StringIO()
    setup_logging("info", "human", "worker", stream=stream)
    get_logger("hivemind.dht.dht").warning("a hivemind warning")
    get_logger("hivemind.dht.dht").info("below WARNING: hidden unless --log-level debug")
    P2P._log_p2pd_message('{"level":"error","ts":"2026-01-02T03:04:05.678+0000","logger":"swarm2",'
                          '"caller":"swarm/swarm.go:1","msg":"dial failed","error":"refused"}')
    logging.getLogger("roles.worker.role").info("ours")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert all(HUMAN_LINE.match(line) for line in lines), lines
    assert lines[0].endswith("WARN  worker  hivemind.dht: a hivemind warning")
    assert "ERROR worker  p2pd: dial failed: refused" in lines[1]
    p2pd_time = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc).astimezone()
    assert lines[1].startswith(p2pd_time.strftime("%H:%M:%S "))  # p2pd's own timestamp, in local time


def test_debug_level_lets_hivemind_debug_through_and_json_format_applies():
    from hivemind.utils.logging import get_logger

    stream = io.StringIO()
    setup_logging("debug", "json", "trainer", stream=stream)
    get_logger("hivemind.averaging").debug("details")
    logging.getLogger("asyncio").info("quiet even at debug")
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(e["logger"], e["level"], e["message"]) for e in entries] == [("hivemind.averaging", "debug", "details")]


def test_setup_twice_leaves_one_handler_and_python_warnings_are_logged():
    import warnings

    stream = io.StringIO()
    logging.basicConfig(stream=sys.stderr)  # a stray default handler is replaced, not kept
    setup_logging("info", "human", "worker", stream=io.StringIO())
    setup_logging("info", "human", "worker", stream=stream)
    warnings.warn("deprecated thing", UserWarning)
    lines = stream.getvalue().splitlines()
    handlers = logging.getLogger().handlers  # pytest adds its own capture handlers
    assert sum(type(h).__name__ == "_AgoraHandler" for h in handlers) == 1
    assert not any(type(h) is logging.StreamHandler for h in handlers)
    assert HUMAN_LINE.match(lines[0]) and "py.warnings" in lines[0] and "deprecated thing" in lines[0]


def _log_in_child():
    from hivemind.utils.logging import get_logger

    get_logger("hivemind.dht.dht").warning("from the forked child")
    logging.getLogger("roles.worker.role").info("ours from the child")


def test_a_forked_child_logs_in_the_same_format(tmp_path):
    path = tmp_path / "stderr.log"
    with open(path, "w") as stream:
        setup_logging("info", "human", "worker", stream=stream)
        child = mp.get_context("fork").Process(target=_log_in_child)
        child.start()
        child.join(30)
    assert child.exitcode == 0
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(HUMAN_LINE.match(line) for line in lines), lines


def test_hivemind_imported_after_setup_is_folded_in_without_importing_it_early():
    """The authorizer sets logging up before it imports hivemind (which pulls in torch)."""
    code = ("import sys, logging\n"
            "from node.logs import setup_logging\n"
            "setup_logging('info', 'human', 'authorizer')\n"
            "assert 'hivemind' not in sys.modules\n"
            "from hivemind.utils.logging import get_logger\n"
            "get_logger('hivemind.p2p').warning('late import')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and HUMAN_LINE.match(lines[0]) and "authorizer hivemind.p2p: late import" in lines[0], lines


def test_bad_format_or_level_is_refused():
    with pytest.raises(ValueError):
        setup_logging("info", "xml", "worker", stream=io.StringIO())
    with pytest.raises(ValueError):
        setup_logging("loud", "human", "worker", stream=io.StringIO())


@pytest.mark.parametrize("level", ["info", "debug"])
def test_an_expected_averaging_failure_is_one_line_not_an_error_with_a_traceback(level):
    from hivemind.averaging.allreduce import AllreduceException
    from hivemind.averaging.matchmaking import MatchmakingException
    from hivemind.utils.logging import get_logger

    stream = io.StringIO()
    setup_logging(level, "human", "worker", stream=stream)
    averager = get_logger("hivemind.averaging.averager")
    for error in (AllreduceException("Averaging step failed: could not find a group"),
                  MatchmakingException("Unable to run All-Reduce: peer left"), RuntimeError("a bug")):
        try:
            raise error
        except Exception as exc:  # noqa: BLE001 - what hivemind's _step does
            averager.exception(exc)
    lines = stream.getvalue().splitlines()
    expected = ["DEBUG worker  hivemind.averaging: averaging step failed: AllreduceException: Averaging step "
                "failed: could not find a group",
                "DEBUG worker  hivemind.averaging: averaging step failed: MatchmakingException: Unable to run "
                "All-Reduce: peer left"] if level == "debug" else []
    assert [line[9:] for line in lines[:len(expected)]] == expected
    rest = lines[len(expected):]
    assert rest[0].endswith("ERROR worker  hivemind.averaging: a bug"[6:]) and "ERROR" in rest[0], rest
    assert any("Traceback" in line for line in rest), "an unexpected failure keeps its traceback"
