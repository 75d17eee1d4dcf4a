"""One logging setup for every role and every process a node starts.

A node's stderr carries lines from three sources: our own loggers, hivemind's loggers (in the
node process, in hivemind's forked DHT and averager processes) and p2pd's go-log lines, which
hivemind parses and re-logs under `hivemind.p2p.p2p_daemon`. `setup_logging` sends all of them
through one handler on the root logger, so they come out in one format:

    human (default)   20:41:07 INFO  worker   trainer.role: every stage has a worker
    json              {"ts": "2026-11-30T20:41:07.123+01:00", "level": "info", "role": "worker", ...}

hivemind installs its own handler on its `hivemind` logger and stops propagation; its documented
knob `use_hivemind_log_handler("nowhere")` takes that handler away and lets the records propagate
to ours. The children hivemind forks inherit the root logger as it is at fork time, so setting
up before the swarm is joined is enough for them too.
"""

from __future__ import annotations

import datetime
import importlib.abc
import importlib.util
import json
import logging
import os
import sys
import traceback
from typing import Callable, Literal, Optional, TextIO

LogFormat = Literal["human", "json"]

QUIET_LOGGERS = ("asyncio", "httpx", "httpcore", "uvicorn", "uvicorn.error", "uvicorn.access", "urllib3")
"""Third-party loggers that say nothing an operator needs below WARNING."""

_LEVEL_NAMES = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARN",
                logging.ERROR: "ERROR", logging.CRITICAL: "FATAL"}
# hivemind renames WARNING to "WARN" globally (logging.addLevelName); we use our own names so the
# level column does not depend on who was imported first.

_LEVEL_STYLES = {logging.DEBUG: "dim", logging.WARNING: "bold yellow", logging.ERROR: "bold red",
                 logging.CRITICAL: "bold white on red"}

_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
# Everything else on a record came from `extra=`; the JSON format keeps it. hivemind's
# `origin_created` and `caller` are folded into ts and logger instead.
_HIVEMIND_EXTRAS = frozenset({"origin_created", "caller", "caller_block", "levelcolor", "bold", "reset"})

_P2PD_LOGGER = "hivemind.p2p.p2p_daemon"

_AVERAGER_LOGGER = "hivemind.averaging.averager"
EXPECTED_AVERAGING_FAILURES = frozenset({("hivemind.averaging.partition", "AllreduceException"),
                                         ("hivemind.averaging.matchmaking", "MatchmakingException")})
"""(module, class) of the exceptions with which an averaging step fails in a healthy swarm: no
group formed in time, a member left or refused the group. Named, not imported: hivemind is
imported late."""


def short_name(record: logging.LogRecord) -> str:
    """The logger column: our package prefixes dropped, hivemind's cut to its subpackage, and
    p2pd's relayed lines named `p2pd`."""
    name = record.name
    if name == _P2PD_LOGGER and hasattr(record, "caller") and (
            hasattr(record, "origin_created") or getattr(record, "caller") == "p2pd"):
        return "p2pd"
    for prefix in ("agora.", "roles."):
        if name.startswith(prefix):
            return name[len(prefix):]
    if name.startswith("hivemind."):
        return ".".join(name.split(".")[:2])
    return name


def _created(record: logging.LogRecord) -> float:
    """When the event happened: p2pd's own timestamp for its relayed lines."""
    origin = getattr(record, "origin_created", None)
    return origin if isinstance(origin, (int, float)) else record.created


class HumanFormatter(logging.Formatter):
    """`HH:MM:SS LEVEL role logger: message`, local time. Continuation lines of a multi-line
    message or a traceback are indented under it, so every line either starts a record or
    visibly belongs to the one above."""

    def __init__(self, role: str, colors: bool = False):
        super().__init__()
        self.role = role
        self.colors = colors

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(_created(record)).strftime("%H:%M:%S")
        level = _LEVEL_NAMES.get(record.levelno, record.levelname)
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            text += "\n" + record.exc_text
        if record.stack_info:
            text += "\n" + record.stack_info
        first, *rest = text.rstrip().split("\n")
        if self.colors:
            level_text = _styled(f"{level:<5}", _LEVEL_STYLES.get(record.levelno))
            if record.levelno >= logging.WARNING:
                first = _styled(first, "yellow" if record.levelno == logging.WARNING else "red")
        else:
            level_text = f"{level:<5}"
        head = f"{when} {level_text} {self.role:<7} {short_name(record)}: {first}"
        return "\n".join([head, *("    " + line for line in rest)])


def _styled(text: str, style: Optional[str]) -> str:
    if not style:
        return text
    from rich.style import Style

    return Style.parse(style).render(text)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (ISO 8601 with the local offset), level, role, logger,
    message, then any `extra=` fields; `exc` holds a traceback."""

    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(_created(record)).astimezone()
        entry = {
            "ts": ts.isoformat(timespec="milliseconds"),
            "level": _LEVEL_NAMES.get(record.levelno, record.levelname).lower(),
            "role": self.role,
            "logger": short_name(record),
            "message": record.getMessage(),
        }
        if short_name(record) == "p2pd" and getattr(record, "caller", "p2pd") != "p2pd":
            entry["caller"] = record.caller
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in _HIVEMIND_EXTRAS and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            entry["exc"] = record.exc_text
        return json.dumps(entry, default=str, ensure_ascii=False)


class _AgoraHandler(logging.StreamHandler):
    """Marks the handler we install, so a second setup replaces it instead of adding another."""


def setup_logging(level: str = "info", fmt: LogFormat = "human", role: str = "node",
                  stream: Optional[TextIO] = None) -> None:
    """Route every log record of this process (and of the children it forks later) to `stream`
    (stderr) in one format. `level` is the node's level; hivemind stays at WARNING unless it is
    `debug` (or HIVEMIND_LOGLEVEL says otherwise); asyncio, httpx, httpcore and uvicorn stay at
    WARNING. Colours only when the stream is a terminal and NO_COLOR is unset."""
    if fmt not in ("human", "json"):
        raise ValueError(f"log format must be 'human' or 'json', not {fmt!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    stream = stream if stream is not None else sys.stderr
    handler = _AgoraHandler(stream)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        colors = _isatty(stream) and "NO_COLOR" not in os.environ
        handler.setFormatter(HumanFormatter(role, colors=colors))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _AgoraHandler) or _is_default_stderr_handler(h)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, numeric))
    logging.captureWarnings(True)  # `warnings.warn` from torch & co. in the same format

    hivemind_level = os.environ.get("HIVEMIND_LOGLEVEL", "DEBUG" if numeric <= logging.DEBUG else "WARNING")
    if logging.getLevelName(hivemind_level.upper()) not in (logging.DEBUG, logging.INFO):
        # p2pd's go-log INFO and WARN lines are relayed at DEBUG by hivemind anyway; do not emit them.
        os.environ.setdefault("GOLOG_LOG_LEVEL", "error")
    _after_import("hivemind.utils.logging", lambda: _fold_hivemind(hivemind_level.upper()))


def _fold_hivemind(level: str) -> None:
    """Take hivemind's own handler away (its documented knob) so its records reach ours."""
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(level)
    averager = logging.getLogger(_AVERAGER_LOGGER)
    if not any(isinstance(f, ExpectedAveragingFailures) for f in averager.filters):
        averager.addFilter(ExpectedAveragingFailures())


class ExpectedAveragingFailures(logging.Filter):
    """hivemind's averager logs every failed step with `logger.exception`: an ERROR and a
    traceback for 'could not find a group', which a healthy swarm sees whenever a replica's round
    falls due alone. The worker reports every round itself, failed ones included, in one line with
    the reason ('averaging: step round 12 ...: failed ...; AllreduceException: ...'). So an
    expected failure (EXPECTED_AVERAGING_FAILURES) becomes one DEBUG line without the traceback,
    shown only when hivemind logs at DEBUG; anything else keeps its ERROR and traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or not any((cls.__module__, cls.__name__) in EXPECTED_AVERAGING_FAILURES
                                    for cls in type(error).__mro__):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg, record.args = f"averaging step failed: {type(error).__name__}: {error}", ()
        record.exc_info = record.exc_text = None
        return logging.getLogger("hivemind").isEnabledFor(logging.DEBUG)


def _after_import(module: str, callback: Callable[[], None]) -> None:
    """Run `callback` now if `module` is imported, else right after it is. hivemind pulls in
    torch (seconds); a process that imports it late (the authorizer) must not pay that at start
    just to configure logging."""
    if module in sys.modules:
        callback()
        return
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImportFinder) and finder.module == module:
            finder.callback = callback
            return
    sys.meta_path.insert(0, _AfterImportFinder(module, callback))


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, callback: Callable[[], None]):
        self.module = module
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_callback(mod):
            exec_module(mod)
            callback()

        spec.loader.exec_module = exec_then_callback
        return spec


def _is_default_stderr_handler(handler: logging.Handler) -> bool:
    """A handler logging.basicConfig or an earlier library left on stderr: replaced by ours."""
    return type(handler) is logging.StreamHandler and getattr(handler, "stream", None) in (sys.stderr, sys.__stderr__)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
