"""`agora-node status` in-process: the table drawn from an overview, and every failure as one line
with its exit code. (Against a live swarm: tests/integration/test_status_cli.py.)"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from node import status_cli
from node.status_cli import AuthorizerSource, render_plain, render_rich, status_main
from protocol.errors import ConfigError

OVERVIEW = {
    "run_id": "run-x", "num_stages": 2, "updated_at": 1000.0, "interval_s": 2.0,
    "stages": [
        {"stage": 0, "replicas": 2, "min_replicas": 1, "phases": {"active": 2, "weight_sync": 0, "optimizer_sync": 0,
                                                                "leaving": 0},
         "step": 12, "throughput": 31.5, "averaging": {"complete": 4, "partial": 1, "failed": 0, "skipped": 3,
                                                       "success_rate": 0.8, "last_round_at": 990.0}},
        {"stage": 1, "replicas": 0, "min_replicas": 1, "phases": {"active": 0, "weight_sync": 0, "optimizer_sync": 0,
                                                                "leaving": 0},
         "step": None, "throughput": 0.0, "averaging": {"complete": 0, "partial": 0, "failed": 0, "skipped": 0,
                                                        "success_rate": None, "last_round_at": None}},
    ],
    "training": {"samples": 1234, "tokens": 78976, "loss": 3.21, "tokens_per_s": 2821.4, "trainers": 2,
                 "eval_loss": 3.4567, "eval_step": 40},
    "nodes": {"present": 4, "gone": 1, "admitted": 5, "queued": 0},
    "alerts": [{"id": 1, "kind": "stage_short", "severity": "critical", "subject": "stage 1",
                "message": "no worker serves stage 1", "first_at": 990.0, "last_at": 999.0, "resolved_at": None}],
}


def test_plain_table_shows_stages_training_and_alerts():
    text = render_plain(OVERVIEW, now=1003.0)
    assert "run run-x" in text and "snapshot 3s ago" in text
    assert "loss 3.210" in text and "tokens/s 2,821" in text and "samples 1,234" in text and "trainers 2" in text
    assert "held-out 3.457 @ step 40" in text
    with_error = {**OVERVIEW, "training": {**OVERVIEW["training"], "eval_stderr": 0.0312}}
    assert "held-out 3.457 +- 0.031 @ step 40" in render_plain(with_error, now=1003.0)
    older = {**OVERVIEW, "training": {k: v for k, v in OVERVIEW["training"].items() if not k.startswith("eval_")}}
    assert "held-out -" in render_plain(older, now=1003.0), "an older authorizer's overview has no held-out loss"
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("stage "))
    assert "replicas/min" in header and "avg success" in header
    row0 = next(line for line in lines if line.startswith("0 "))
    assert row0.split() == ["0", "2/1", "2", "0", "0", "0", "12", "31.5", "4/1/0/3", "80%"]
    row1 = next(line for line in lines if line.startswith("1 "))
    assert row1.split()[:2] == ["1", "0/1"] and row1.split()[-1] == "-"
    assert "CRITICAL stage_short stage 1: no worker serves stage 1" in text


def test_text_from_the_source_cannot_drive_the_terminal():
    hostile = {**OVERVIEW, "run_id": "x\x1b[2J[bold]y", "alerts": [{**OVERVIEW["alerts"][0], "message": "\x1b]0;pwned\x07"}]}
    assert "\x1b" not in render_plain(hostile) and "\x07" not in render_plain(hostile)
    from rich.console import Console

    console = Console(width=140, record=True, force_terminal=False)
    console.print(render_rich(hostile))
    out = console.export_text()
    assert "\x1b" not in out and "x?[2J[bold]y" in out


def test_rich_table_renders():
    from rich.console import Console

    console = Console(width=140, record=True, force_terminal=False)
    console.print(render_rich(OVERVIEW, now=1003.0, error="12:00:00 cannot reach"))
    out = console.export_text()
    assert "replicas/min" in out and "4/1/0/3" in out and "CRITICAL" in out and "cannot reach" in out


def _serve(monkeypatch, handler):
    """AuthorizerSource answered by `handler` (an httpx MockTransport) instead of the network."""
    real = AuthorizerSource.__init__

    def init(self, url, timeout_s):
        real(self, url, timeout_s)
        self.client = httpx.Client(transport=httpx.MockTransport(handler))

    monkeypatch.setattr(AuthorizerSource, "__init__", init)


def test_json_prints_the_overview(monkeypatch, capsys):
    _serve(monkeypatch, lambda request: httpx.Response(200, json=OVERVIEW))
    assert status_main(["--authorizer", "http://authorizer:8000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == OVERVIEW


@pytest.mark.parametrize("status, body, code, words", [
    (503, {"error": {"code": "monitor_off", "message": "off"}}, 2, "runs no health monitor"),
    (404, {"error": {"code": "not_found", "message": "no endpoint"}}, 2, "no /v1/monitor API"),
    (500, {"error": {"code": "internal", "message": "boom"}}, 1, "failed (500 internal: boom)"),
    (200, "<html>", 2, "without JSON"),
])
def test_answers_that_are_not_an_overview_are_one_line(monkeypatch, capsys, status, body, code, words):
    def handler(request):
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    _serve(monkeypatch, handler)
    assert status_main(["--authorizer", "http://authorizer:8000"]) == code
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err and "Traceback" not in err


def test_unreachable_authorizer_is_one_line_and_exit_2(capsys):
    with socket.socket() as closed:  # bound, never listening: connections are refused while we hold it
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        assert status_main(["--authorizer", f"http://127.0.0.1:{port}", "--timeout-s", "5"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot reach the authorizer" in err


@pytest.mark.parametrize("argv, words", [
    (["--authorizer", "not a url"], "not an http(s) URL"),
    (["--authorizer", "ftp://host"], "not an http(s) URL"),
    ([], "give either --authorizer URL or --initial-peers"),
    (["--authorizer", "http://a:1", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "give either"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1"], "needs --config"),
    (["--authorizer", "http://a:1", "--interval-s", "0"], "must be positive"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, words):
    assert status_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err


def test_watch_ends_cleanly_on_ctrl_c(monkeypatch, capsys):
    reads = []

    def handler(request):
        reads.append(1)
        if len(reads) == 2:
            return httpx.Response(503, json={"error": {"code": "monitor_off", "message": "off"}})
        return httpx.Response(200, json=OVERVIEW)

    _serve(monkeypatch, handler)
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(status_cli.time, "sleep", sleep)
    assert status_main(["--authorizer", "http://authorizer:8000", "--watch", "--interval-s", "0.5"]) == 0
    out, err = capsys.readouterr()
    assert out.count("run run-x") == 2 and "runs no health monitor" in err and sleeps == [0.5, 0.5, 0.5]


def test_config_error_type_is_the_usage_one():
    with pytest.raises(ConfigError):
        AuthorizerSource("http://", 1.0)
