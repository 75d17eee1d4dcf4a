"""The dashboard page at /dashboard (placeholder)."""

from fastapi import APIRouter

dashboard_router = APIRouter(tags=["dashboard"])
