"""The API's own description: `/openapi.json`, Swagger UI at `/docs`, ReDoc at `/redoc`.

FastAPI's built-in routes for these take no dependencies, so the app turns them off and serves
them here, behind the bearer token when `api_key` is set (unless `public_metadata`). A browser
cannot send the token to `/docs`; with a key, read `/openapi.json` with it (or open the
metadata with `public_metadata`).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from service.api.auth import require_api_key_for_metadata

OPENAPI_URL = "/openapi.json"

router = APIRouter(include_in_schema=False, dependencies=[Depends(require_api_key_for_metadata)])


@router.get(OPENAPI_URL)
async def openapi(request: Request) -> JSONResponse:
    """The OpenAPI document of the app."""
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI over the OpenAPI document."""
    return get_swagger_ui_html(openapi_url=OPENAPI_URL, title=f"{request.app.title} - Swagger UI")


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    """ReDoc over the OpenAPI document."""
    return get_redoc_html(openapi_url=OPENAPI_URL, title=f"{request.app.title} - ReDoc")
