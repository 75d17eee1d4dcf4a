"""Small helpers shared by the authorizer tests."""

from __future__ import annotations

import httpx

from authorizer.testing import AuthorizerProcess

ADMIN_TOKEN = "test-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def client(process: AuthorizerProcess) -> httpx.Client:
    return httpx.Client(base_url=process.url, timeout=30)
