"""The push front: nodes push metrics here with a credential-derived token (placeholder)."""

from fastapi import APIRouter

push_router = APIRouter(prefix="/v1/metrics", tags=["metrics"])
