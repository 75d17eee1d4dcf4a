"""The health monitor's JSON API under /v1/monitor (placeholder until the monitor lands)."""

from fastapi import APIRouter

monitor_router = APIRouter(prefix="/v1/monitor", tags=["monitor"])
