"""Small helpers shared by the authorizer tests."""

from __future__ import annotations

import time

import httpx

from authorizer.testing import AuthorizerProcess

ADMIN_TOKEN = "test-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, message: str = "condition"):
    """Poll `predicate` until it returns a truthy value, or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {message}")
        time.sleep(interval_s)


def client(process: AuthorizerProcess) -> httpx.Client:
    return httpx.Client(base_url=process.url, timeout=30)
