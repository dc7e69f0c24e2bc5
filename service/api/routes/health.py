"""Health routes: liveness (the process answers) and readiness (models loaded, not draining)."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.routes.deps import RegistryDep
from service.api.schemas import ErrorBody, Health
from service.core.errors import NotReady

router = APIRouter(tags=["health"])


@router.get("/health/live")
async def live() -> Health:
    """200 while the process serves HTTP."""
    return Health(status="live")


@router.get("/health/ready", responses={503: {"model": ErrorBody}})
async def ready(registry: RegistryDep) -> Health:
    """200 once every model loaded, passed its hash check and warmed up; 503 otherwise."""
    if not registry.ready:
        raise NotReady(registry.not_ready_reason())
    return Health(status="ready", models={e.name: e.state == "ready" for e in registry.entries})
