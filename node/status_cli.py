"""`agora-node status`: the run's state in a terminal, for people and for scripts.

Two sources give the same overview (the shape of the authorizer's GET /v1/monitor/overview):
the authorizer's health monitor (`--authorizer URL`, its history and alerts included), or the DHT
itself (`--initial-peers MADDR --config RUN`), read as a DHT client that announces nothing. The
DHT of an authenticated run answers admitted nodes only, so there the authorizer is the way in.
A terminal gets a rich table, a pipe plain lines, `--json` the overview as JSON; `--watch`
refreshes until Ctrl-C. Every failure is one line and exit code 2 (bad input, unreachable, no
monitor) or 1 (the authorizer failed), as protocol/exit_codes.py says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Callable, Optional

from node.flags import OneLineErrorParser
from protocol.errors import AgoraError, ConfigError
from protocol.exit_codes import ExitCode

PROG = "agora-node status"

USAGE = """
  agora-node status --authorizer URL [--json] [--watch [--interval-s N]]
  agora-node status --initial-peers MADDR [MADDR ...] --config NAME|PATH [--run-id ID] [--json] [--watch]"""


class StatusFailed(AgoraError):
    """The source answered, but with a failure of its own (exit 1)."""


def status_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog=PROG, usage=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Show a run's stages (replicas, phases, step, throughput, averaging health), its training\n"
                    "progress (loss, tokens/s, samples) and active alerts. The dashboard shows the same and more\n"
                    "at <authorizer URL>/dashboard.",
        epilog="exit codes: 0 shown (or --watch ended with Ctrl-C); 2 bad flags, source unreachable or the\n"
               "authorizer runs no health monitor; 1 the authorizer failed.",
    )
    source = p.add_argument_group("where to read the run (one of)")
    source.add_argument("--authorizer", metavar="URL",
                        help="the run's authorizer, e.g. http://host:8000: its health monitor's overview, alerts included")
    source.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                        help="read the DHT directly through these peers (open runs only: an authenticated run's DHT "
                             "answers admitted nodes only); needs --config")
    dht = p.add_argument_group("with --initial-peers")
    dht.add_argument("--config", metavar="NAME|PATH", help="the run's config (a preset or the YAML the nodes use): its "
                                                           "run id and number of stages")
    dht.add_argument("--run-id", metavar="ID", help="the run id, if not the config's")
    dht.add_argument("--host-maddrs", nargs="+", metavar="MADDR", default=["/ip4/0.0.0.0/tcp/0"],
                     help="where the DHT client listens (default: /ip4/0.0.0.0/tcp/0); it announces nothing")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the overview as one JSON object (one a line with --watch)")
    out.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    out.add_argument("--interval-s", type=float, default=2.0, metavar="SECONDS",
                     help="seconds between refreshes with --watch (default: 2)")
    out.add_argument("--timeout-s", type=float, default=15.0, metavar="SECONDS",
                     help="how long to wait for the authorizer or the initial peers (default: 15)")
    return p


# ---- sources ----


class AuthorizerSource:
    """The overview and active alerts from the authorizer's health monitor (GET /v1/monitor/overview)."""

    def __init__(self, url: str, timeout_s: float):
        import httpx

        self.url = url.rstrip("/")
        try:
            parsed = httpx.URL(self.url)
        except httpx.InvalidURL as exc:
            raise ConfigError(f"--authorizer: {url[:120]!r} is not a URL ({exc}); expected e.g. http://host:8000") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ConfigError(f"--authorizer: {url[:120]!r} is not an http(s) URL; expected e.g. http://host:8000")
        self.timeout_s = timeout_s
        self.client = httpx.Client(timeout=timeout_s, headers={"Accept": "application/json"})

    def read(self) -> dict:
        import httpx

        try:
            response = self.client.get(f"{self.url}/v1/monitor/overview")
        except httpx.TimeoutException:
            raise ConfigError(f"the authorizer at {self.url} did not answer within {self.timeout_s:g}s; "
                              "check the URL, or retry with a larger --timeout-s") from None
        except httpx.HTTPError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"cannot reach the authorizer at {self.url} ({reason}); check --authorizer and that "
                              "the authorizer is running") from None
        try:
            body = response.json()
        except ValueError:
            raise ConfigError(f"{self.url} answered {response.status_code} without JSON; is --authorizer the "
                              "authorizer's URL (http://host:8000)?") from None
        if response.status_code == 200 and isinstance(body, dict) and "stages" in body:
            return body
        error = body.get("error", {}) if isinstance(body, dict) else {}
        code = str(error.get("code", "")) if isinstance(error, dict) else ""
        message = str(error.get("message", "")) if isinstance(error, dict) else ""
        if response.status_code == 503 and code == "monitor_off":
            raise ConfigError(f"the authorizer at {self.url} runs no health monitor (started with --no-monitor); "
                              "ask its operator, or in an open run read the DHT with --initial-peers and --config")
        if response.status_code == 404:
            raise ConfigError(f"{self.url} has no /v1/monitor API: not an agora-node authorizer, or an older version; "
                              "check --authorizer")
        if 400 <= response.status_code < 500 or response.status_code == 200:
            raise ConfigError(f"the authorizer at {self.url} refused the request ({response.status_code} "
                              f"{code or 'unexpected answer'}: {message[:200]})")
        raise StatusFailed(f"the authorizer at {self.url} failed ({response.status_code} {code}: {message[:200]}); "
                           "retry, and tell its operator if it persists")

    def close(self) -> None:
        self.client.close()


class DhtSource:
    """The overview built from the DHT records every node announces (protocol/dht_schema.py), read
    as a DHT client: the shape of the monitor's overview, without its history, admissions or
    alerts. Tokens/s is the rate between two reads, so it shows from the second one on."""

    def __init__(self, initial_peers: list[str], run_id: str, num_stages: int, host_maddrs: list[str],
                 timeout_s: float):
        self.run_id, self.num_stages, self.timeout_s = run_id, num_stages, timeout_s
        self.membership = None
        self.identity = None
        self.previous: Optional[tuple[float, int]] = None
        self.loop = asyncio.new_event_loop()
        self._join(initial_peers, host_maddrs)

    def _join(self, initial_peers: list[str], host_maddrs: list[str]) -> None:
        from node.swarm import join_swarm
        from protocol.identity import load_or_create_identity

        logging.getLogger("hivemind").setLevel(logging.CRITICAL)  # its retries are not the user's business
        self.identity = load_or_create_identity(None)
        try:
            self.membership = join_swarm(identity=self.identity, run_id=self.run_id, num_stages=self.num_stages,
                                         initial_peers=initial_peers, host_maddrs=host_maddrs, announce_maddrs=[],
                                         bootstrap_timeout_s=self.timeout_s, client_mode=True)
        except ConfigError as exc:
            self.close()
            if "responded to a ping" in str(exc):  # hivemind's words when every peer refused us
                raise ConfigError("the initial peers do not answer an unadmitted DHT client: this run is "
                                  "authenticated; use agora-node status --authorizer URL") from None
            raise

    def read(self) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:  # a DHT client that has just joined may not see every record on its first read
            overview = self.loop.run_until_complete(self._read())
            seen = sum(s["replicas"] for s in overview["stages"]) + overview["training"]["trainers"]
            if seen or time.monotonic() > deadline:
                return overview
            time.sleep(0.5)

    async def _read(self) -> dict:
        from authorizer.monitor.progress import run_eval
        from protocol.dht import SwarmDHT
        from protocol.dht_schema import (AveragingRecord, Phase, ProgressRecord, TrainerRecord, WorkerRecord,
                                         averaging_key, progress_key, trainers_key, workers_key)

        dht = SwarmDHT(self.membership.dht, self.identity.peer_id.to_base58(), timeout_s=self.timeout_s)
        n = self.num_stages
        found = await asyncio.gather(
            *(dht.get(workers_key(self.run_id, s), WorkerRecord) for s in range(n)),
            *(dht.get(progress_key(self.run_id, s), ProgressRecord) for s in range(n)),
            *(dht.get(averaging_key(self.run_id, s), AveragingRecord) for s in range(n)),
            dht.get(trainers_key(self.run_id), TrainerRecord))
        workers, progress, averaging, reports = found[:n], found[n:2 * n], found[2 * n:3 * n], found[3 * n]
        trainers = {peer: report for peer, report in reports.items() if not report.final}  # final: it left
        stages = []
        for s in range(n):
            phases = {phase.value: 0 for phase in Phase}
            for record in workers[s].values():
                phases[record.phase.value] += 1
            rounds = {status: sum(getattr(r, f"rounds_{status}") for r in averaging[s].values())
                      for status in ("complete", "partial", "failed", "skipped")}
            tried = rounds["complete"] + rounds["partial"] + rounds["failed"]
            finished = [r.finished_at for a in averaging[s].values() for r in a.recent if r.finished_at]
            stages.append({
                "stage": s, "replicas": len(workers[s]), "min_replicas": 1, "phases": phases,
                "step": max((p.local_step for p in progress[s].values()), default=None),
                "throughput": round(sum(w.throughput for w in workers[s].values()), 3),
                "averaging": {"method": "sparseloco" if any(a.method == "sparseloco" for a in averaging[s].values())
                              else "asyncsparta",
                              **rounds, "success_rate": rounds["complete"] / tried if tried else None,
                              "last_round_at": max(finished, default=None)},
            })
        now = time.time()
        tokens = sum(t.tokens for t in reports.values())
        rate = None
        if self.previous is not None and now > self.previous[0] and tokens >= self.previous[1]:
            rate = round((tokens - self.previous[1]) / (now - self.previous[0]), 1)
        self.previous = (now, tokens)
        losses = [t.recent_loss for t in trainers.values() if t.recent_loss is not None]
        eval_loss, eval_step, eval_stderr = run_eval(trainers, set(trainers))
        return {
            "run_id": self.run_id, "num_stages": n, "updated_at": now, "interval_s": 0.0, "stages": stages,
            "training": {"samples": sum(t.samples_completed for t in reports.values()), "tokens": tokens,
                         "loss": sum(losses) / len(losses) if losses else None, "tokens_per_s": rate,
                         "trainers": len(trainers), "eval_loss": eval_loss, "eval_step": eval_step,
                         "eval_stderr": eval_stderr},
            "nodes": {"present": sum(len(w) for w in workers) + len(trainers), "gone": None, "admitted": None,
                      "queued": None},
            "alerts": [],
            "source": "dht",
        }

    def close(self) -> None:
        import os

        if self.membership is not None:
            self.membership.shutdown()
            self.membership = None
        if self.identity is not None and os.path.exists(self.identity.path):
            os.unlink(self.identity.path)
        if not self.loop.is_closed():
            self.loop.close()


# ---- rendering: one set of rows, drawn as a rich table or as plain text ----

STAGE_COLUMNS = ["stage", "replicas/min", "active", "w-sync", "opt-sync", "leaving", "step", "samples/s",
                 "avg ok/part/fail/skip", "avg success"]


_CONTROL = {c: "?" for c in [*range(0x00, 0x20), 0x7f, *range(0x80, 0xa0)]}


def _clean(text: str) -> str:
    """A source's text with control characters replaced: an escape sequence in an alert or a run
    id must not drive the user's terminal."""
    return str(text).translate(_CONTROL)


def _num(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and digits:
        return f"{value:.{digits}f}"
    return f"{value:,.0f}" if isinstance(value, (int, float)) else str(value)


def _rate(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _age(unix_s, now: float) -> str:
    if unix_s is None:
        return "never"
    seconds = max(0.0, now - unix_s)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def stage_rows(overview: dict) -> list[list[str]]:
    rows = []
    for s in overview.get("stages", []):
        phases, avg = s.get("phases", {}), s.get("averaging", {})
        success = avg.get("success_rate")
        rows.append([str(s.get("stage")), f"{_num(s.get('replicas'))}/{_num(s.get('min_replicas'))}",
                     _num(phases.get("active")), _num(phases.get("weight_sync")), _num(phases.get("optimizer_sync")),
                     _num(phases.get("leaving")), _num(s.get("step")), _rate(s.get("throughput")),
                     ("sparseloco " if avg.get("method") == "sparseloco" else "")
                     + "/".join(_num(avg.get(k)) for k in ("complete", "partial", "failed", "skipped")),
                     "-" if success is None else f"{success * 100:.0f}%"])
    return [[_clean(cell) for cell in row] for row in rows]


def summary_lines(overview: dict, now: Optional[float] = None) -> list[str]:
    now = time.time() if now is None else now
    t, n = overview.get("training", {}), overview.get("nodes", {})
    source = "the DHT" if overview.get("source") == "dht" else "the health monitor"
    loss = t.get("loss")
    return [_clean(line) for line in [
        f"run {overview.get('run_id')}  ({overview.get('num_stages')} stages; from {source}, "
        f"snapshot {_age(overview.get('updated_at'), now)})",
        f"training: loss {'-' if loss is None else f'{loss:.3f}'}  {_held_out(t)}  "
        f"tokens/s {_rate(t.get('tokens_per_s'))}  "
        f"samples {_num(t.get('samples'))}  tokens {_num(t.get('tokens'))}  trainers {_num(t.get('trainers'))}",
        f"nodes: {_num(n.get('present'))} present, {_num(n.get('gone'))} gone; {_num(n.get('admitted'))} admitted, "
        f"{_num(n.get('queued'))} queued",
    ]]


def _held_out(training: dict) -> str:
    """The held-out loss and the step it was taken at; '-' before the first evaluation (or from an
    older authorizer, whose overview has neither)."""
    loss, step, stderr = training.get("eval_loss"), training.get("eval_step"), training.get("eval_stderr")
    if not _number(loss):
        return "held-out -"
    return (f"held-out {loss:.3f}" + (f" +- {stderr:.3f}" if _number(stderr) else "")
            + (f" @ step {step}" if isinstance(step, int) and not isinstance(step, bool) else ""))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def alert_lines(overview: dict) -> list[str]:
    alerts = overview.get("alerts") or []
    if overview.get("source") == "dht":
        return ["alerts: none from the DHT (the authorizer's health monitor raises them)"]
    if not alerts:
        return ["alerts: none active"]
    return [_clean(f"{str(a.get('severity', '?')).upper()} {a.get('kind')} {a.get('subject')}: {a.get('message')}")
            for a in alerts]


def render_plain(overview: dict, now: Optional[float] = None) -> str:
    rows = [STAGE_COLUMNS, *stage_rows(overview)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(STAGE_COLUMNS))]
    table = ["  ".join(cell.rjust(widths[i]) if i else cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip()
             for r in rows]
    return "\n".join([*summary_lines(overview, now), "", *table, "", *alert_lines(overview)])


def render_rich(overview: dict, now: Optional[float] = None, error: Optional[str] = None):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = summary_lines(overview, now)
    table = Table(title=None, expand=False, header_style="bold")
    for i, column in enumerate(STAGE_COLUMNS):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row, stage in zip(stage_rows(overview), overview.get("stages", [])):
        short = (stage.get("replicas") or 0) < (stage.get("min_replicas") or 0)
        table.add_row(*(Text(cell) for cell in row), style="red" if short else None)  # Text: no markup
    alerts = Text()
    for line in alert_lines(overview):
        style = "red" if line.startswith("CRITICAL") else "yellow" if line.startswith("WARNING") else "dim"
        alerts.append(line + "\n", style=style)
    parts = [Text(head[0], style="bold"), Text("\n".join(head[1:])), table, alerts]
    if error:
        parts.append(Text(error, style="bold red"))
    return Group(*parts)


# ---- main ----


def _source(args: argparse.Namespace):
    if bool(args.authorizer) == bool(args.initial_peers):
        raise ConfigError("give either --authorizer URL or --initial-peers MADDR (see agora-node status --help)")
    if args.interval_s <= 0 or args.timeout_s <= 0:
        raise ConfigError("--interval-s and --timeout-s must be positive")
    if args.authorizer:
        return AuthorizerSource(args.authorizer, args.timeout_s)
    if not args.config:
        raise ConfigError("--initial-peers needs --config (the run's config: its run id and number of stages)")
    from protocol.run_config import load_run_config

    run = load_run_config(args.config)
    return DhtSource(list(args.initial_peers), args.run_id or run.run_id, run.num_stages, list(args.host_maddrs),
                     args.timeout_s)


def status_main(argv: list[str]) -> int:
    """`agora-node status ...`; returns the exit code, printing one line on any failure."""
    source = None
    _interrupt_on_signals()
    try:
        args = status_parser().parse_args(argv)
        source = _source(args)
        overview = source.read()  # the first read fails loudly, even with --watch
        if not args.watch:
            _print_once(overview, args.json)
            return ExitCode.OK
        return _watch(source, overview, args)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return ExitCode.USAGE
    except StatusFailed as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return ExitCode.FAILURE
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    finally:
        if source is not None:
            source.close()


def _interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM end `--watch` (and a slow read) as KeyboardInterrupt, even when started
    from a process that ignores SIGINT (Python then keeps it ignored: nohup-like launchers, test
    runners)."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt)


def _print_once(overview: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(overview), flush=True)
    elif sys.stdout.isatty():
        from rich.console import Console

        Console().print(render_rich(overview))
    else:
        print(render_plain(overview), flush=True)


def _watch(source, overview: dict, args: argparse.Namespace) -> int:
    """Refresh every --interval-s until Ctrl-C (exit 0). A failed read after the first shows as a
    line and the next refresh tries again: a restarting authorizer is no reason to stop watching."""
    def refresh(current: dict) -> tuple[dict, Optional[str]]:
        try:
            return source.read(), None
        except (ConfigError, StatusFailed) as exc:
            return current, f"{time.strftime('%H:%M:%S')} {exc}"

    try:
        if args.json or not sys.stdout.isatty():
            _watch_lines(overview, args, refresh)
        else:
            _watch_live(overview, args, refresh)
    except KeyboardInterrupt:
        pass
    return ExitCode.OK


def _watch_lines(overview: dict, args, refresh: Callable[[dict], tuple[dict, Optional[str]]]) -> None:
    error = None
    while True:
        if error:
            print(f"{PROG}: {error}", file=sys.stderr, flush=True)
        else:
            print(json.dumps(overview) if args.json else render_plain(overview) + "\n", flush=True)
        time.sleep(args.interval_s)
        overview, error = refresh(overview)


def _watch_live(overview: dict, args, refresh: Callable[[dict], tuple[dict, Optional[str]]]) -> None:
    from rich.live import Live

    with Live(render_rich(overview), refresh_per_second=4, screen=False) as live:
        while True:
            time.sleep(args.interval_s)
            overview, error = refresh(overview)
            live.update(render_rich(overview, error=error))
