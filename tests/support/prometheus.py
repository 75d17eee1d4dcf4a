"""A real Pushgateway and a real Prometheus (the Debian packages scripts/setup installs) on
127.0.0.1, for tests of the metrics pipeline [report 3.6.3].

Both listen on port 0 and are read their real address from the "Listening on" line they log, so
nothing guesses a free port. Each runs in its own process group and `stop()` ends the group (TERM,
then KILL); use them as context managers or from fixtures with finally. `missing()` names the
binary that is not installed, for a skip.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from typing import Any, Optional, Sequence

import httpx
import pytest
import yaml

from tests.support.polling import poll_until

PUSHGATEWAY = "prometheus-pushgateway"
PROMETHEUS = "prometheus"
PROMTOOL = "promtool"
_LISTENING = re.compile(r'msg="Listening on" address=(\S+)')


def missing(*binaries: str) -> Optional[str]:
    """A sentence naming the first binary not on PATH, or None."""
    for binary in binaries or (PUSHGATEWAY, PROMETHEUS):
        if shutil.which(binary) is None:
            return f"{binary} is not installed (scripts/setup installs it: apt-get install {binary})"
    return None


class _Server:
    """A Go server of the Prometheus family, started on 127.0.0.1:0, ready when /-/ready says so."""

    name = "server"

    def __init__(self, workdir: str):
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.log_path = os.path.join(workdir, f"{self.name}.log")
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout_s: float = 60) -> "_Server":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         start_new_session=True)
        try:
            address = poll_until(self._address, timeout_s, f"{self.name} to log its address", period_s=0.1)
            self.url = f"http://{address}"
            poll_until(self._ready, timeout_s, f"{self.name} at {self.url} to be ready", period_s=0.2)
        except BaseException:
            tail = self.log_tail()
            self.stop()
            raise AssertionError(f"{self.name} did not start:\n{tail}") from None
        return self

    def _address(self) -> Optional[str]:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        match = _LISTENING.search(self.log_tail(100_000))
        return match.group(1) if match else None

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15) -> None:
        """TERM, wait, then KILL the process group; idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Pushgateway(_Server):
    """`prometheus-pushgateway` on 127.0.0.1:0, in memory (no persistence file)."""

    name = "pushgateway"

    def argv(self) -> list[str]:
        return [PUSHGATEWAY, "--web.listen-address=127.0.0.1:0"]

    def metrics_text(self) -> str:
        """What Prometheus would scrape from it."""
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def groups(self) -> list[dict[str, Any]]:
        """The pushed groups' labels (its /api/v1/metrics)."""
        data = httpx.get(f"{self.url}/api/v1/metrics", timeout=10).json()["data"]
        return [group["labels"] for group in data]


class Prometheus(_Server):
    """`prometheus` on 127.0.0.1:0 scraping `scrape_configs` every second, storing under workdir."""

    name = "prometheus"

    def __init__(self, workdir: str, scrape_configs: Sequence[dict[str, Any]], *,
                 rule_files: Sequence[str] = (), interval_s: float = 1.0):
        super().__init__(workdir)
        self.config_path = os.path.join(workdir, "prometheus.yml")
        config = {
            "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s",
                       "scrape_timeout": f"{interval_s:g}s"},
            "scrape_configs": list(scrape_configs),
        }
        if rule_files:
            config["rule_files"] = list(rule_files)
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)

    def argv(self) -> list[str]:
        return [PROMETHEUS, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir}/data",
                "--web.listen-address=127.0.0.1:0"]

    def query(self, expression: str) -> list[dict[str, Any]]:
        """An instant query through the HTTP API: the result's vector entries (metric, value)."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expression}, timeout=10)
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"query {expression!r} failed: {body}")
        return body["data"]["result"]

    def targets(self) -> list[dict[str, Any]]:
        """The active targets with their health (up/down) and last error."""
        return httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]


def wait_for_series(prometheus: Prometheus, expression: str, timeout_s: float = 90,
                    what: Optional[str] = None) -> list[dict[str, Any]]:
    """Poll `expression` until it returns at least one series; return them."""
    return poll_until(lambda: prometheus.query(expression), timeout_s, what or f"{expression} in Prometheus",
                      period_s=0.5)


def sample_value(series: dict[str, Any]) -> float:
    return float(series["value"][1])


@pytest.fixture(scope="module")
def shared_pushgateway(tmp_path_factory):
    """One real Pushgateway for a test module (import it as the module's `pushgateway` fixture)."""
    reason = missing("prometheus-pushgateway")
    if reason:
        pytest.skip(reason)
    gateway = Pushgateway(str(tmp_path_factory.mktemp("pushgateway")))
    gateway.start()
    try:
        yield gateway
    finally:
        gateway.stop()
