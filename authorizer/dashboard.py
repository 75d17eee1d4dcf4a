"""The dashboard [report 3.6.4]: the run's public window, served by the authorizer at /dashboard.

It is one static page and its script and stylesheet, shipped in the package
(authorizer/dashboard_assets/): the browser draws everything from the JSON API under /v1/monitor
(the health monitor's history) and /v1/run (admissions), polling every few seconds. Nothing is
templated on the server, so nothing an API value carries (a peer id is whatever a node chose to
announce) reaches the page except through the script's `textContent`; the page loads nothing from
elsewhere (no CDN, no fonts, charts drawn as SVG by our own code) and says so in its
Content-Security-Policy. The report's dashboard is a Next.js frontend with its own backend; ours
is the smallest thing that serves both its audiences: the operator and anyone following the run
see loss and throughput over time, stages, nodes and alerts, and a contributor finds their own node
by its peer id (/dashboard/node/<peer id>) and watches its telemetry.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from authorizer.errors import NotFound

ASSETS_DIR = Path(__file__).parent / "dashboard_assets"

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}

ASSETS = frozenset({"dashboard.js", "dashboard.css", "favicon.svg"})
"""What /dashboard/assets/ serves: a fixed list, so a path can never name another file."""

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "font-src 'none'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)

_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # the page and its assets change with the package, not while it runs; revalidate each load
    "Cache-Control": "no-cache",
}

MAX_PEER_ID_CHARS = 128

dashboard_router = APIRouter(tags=["dashboard"])


def _asset(name: str) -> Response:
    path = ASSETS_DIR / name
    try:
        body = path.read_bytes()
    except OSError as exc:  # a broken install: the package data was not shipped
        raise NotFound(f"dashboard asset {name} is missing from this installation; reinstall agora-node") from exc
    return Response(body, media_type=_TYPES[path.suffix], headers=_HEADERS)


@dashboard_router.get("/dashboard", include_in_schema=False)
async def overview_page() -> Response:
    """The run at a glance: totals, loss and tokens/s over time, stages, nodes, admissions, alerts."""
    return _asset("index.html")


@dashboard_router.get("/dashboard/node/{peer_id:path}", include_in_schema=False)
async def node_page(peer_id: str) -> Response:
    """One node's live telemetry. The same page: the script reads the peer id from the address."""
    if len(peer_id) > MAX_PEER_ID_CHARS:
        raise NotFound(f"a peer id has at most {MAX_PEER_ID_CHARS} characters; check the address")
    return _asset("index.html")


@dashboard_router.get("/dashboard/assets/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in ASSETS:
        raise NotFound("there is no such dashboard asset; the page is at /dashboard")
    return _asset(name)
