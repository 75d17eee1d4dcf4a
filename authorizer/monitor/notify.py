"""Where alerts go when they are raised or resolved: one log line each (logger `agora.monitor`)
and, with `--alert-webhook URL`, one JSON POST each:

    {"run_id": "...", "event": "raised" | "resolved", "alert": {id, kind, severity, subject,
     message, first_at, last_at, resolved_at}}

A POST runs in the background with a short timeout; a failure is logged and never holds up the
monitor. At most `MAX_PENDING` posts wait at once: beyond that, new ones are dropped (and logged),
so a dead webhook cannot pile up memory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import httpx

from authorizer.monitor.health import Alert

logger = logging.getLogger("agora.monitor")

WEBHOOK_TIMEOUT_S = 5.0
MAX_PENDING = 64


class Notifier:
    def __init__(self, run_id: str, webhook_url: Optional[str]):
        self.run_id = run_id
        self.webhook_url = webhook_url
        self._http: Optional[httpx.AsyncClient] = None
        self._pending: set[asyncio.Task] = set()
        self.posted = 0
        self.failed = 0

    def alert(self, event: str, alert: Alert) -> None:
        """Log `alert` ('raised' or 'resolved') and post it to the webhook, if any."""
        if event == "raised":
            level = logging.ERROR if alert.severity == "critical" else logging.WARNING
            logger.log(level, "alert %s [%s] %s: %s", alert.kind, alert.severity, alert.subject, alert.message)
        else:
            logger.info("alert resolved: %s %s (active %.0f s)", alert.kind, alert.subject,
                        (alert.resolved_at or alert.last_at) - alert.first_at)
        if self.webhook_url is None:
            return
        if len(self._pending) >= MAX_PENDING:
            logger.warning("alert webhook %s is not keeping up (%d posts pending); this %s of %s %s is not posted",
                           self.webhook_url, len(self._pending), event, alert.kind, alert.subject)
            return
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=WEBHOOK_TIMEOUT_S)
        task = asyncio.create_task(self._post({"run_id": self.run_id, "event": event, "alert": alert.as_json()}))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _post(self, payload: dict) -> None:
        try:
            response = await self._http.post(self.webhook_url, json=payload)
            if response.status_code >= 300:
                raise httpx.HTTPStatusError(f"answered {response.status_code}", request=response.request,
                                            response=response)
            self.posted += 1
        except Exception as exc:  # anything the webhook or the network does is logged, never raised
            self.failed += 1
            logger.warning("alert webhook %s failed (%s); the alert is in the log and at /v1/monitor/alerts",
                           self.webhook_url, str(exc) or type(exc).__name__)

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Give pending posts `timeout_s` to finish, then cancel them and close the client."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)
        for task in list(self._pending):
            task.cancel()
        if self._http is not None:
            await self._http.aclose()
