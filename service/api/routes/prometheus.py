"""`GET /metrics`: the Prometheus exposition of `service.observability.metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Response

from service.observability.metrics import render_latest

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def prometheus_metrics() -> Response:
    """Every attnserve metric in the classic text format."""
    body, content_type = render_latest()
    return Response(content=body, media_type=content_type)
