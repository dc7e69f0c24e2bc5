"""Dependencies of the routes: the settings and the model registry of the running app, and the
inference routes' one dependency, which checks the request before giving both.

All are `async def`: FastAPI runs a plain `def` dependency in its thread pool, two thread
hops per request for an attribute lookup (and a wait for a core when the model's threads
hold them all). An inference route takes one dependency, not one per check: FastAPI solves
each dependency of each request anew."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from service.api.auth import check_api_key
from service.api.media_type import check_json
from service.core.registry import ModelRegistry
from service.core.settings import Settings


async def get_settings(request: Request) -> Settings:
    """The app's settings."""
    settings: Settings = request.app.state.settings
    return settings


async def get_registry(request: Request) -> ModelRegistry:
    """The app's model registry."""
    registry: ModelRegistry = request.app.state.registry
    return registry


@dataclass(frozen=True)
class Serving:
    """What an inference route works with: the app's model registry and settings."""

    registry: ModelRegistry
    settings: Settings


def _serving(request: Request) -> Serving:
    """The app's `Serving` (`app.state.serving`, set by `create_app`) once the request's bearer
    token is checked (`service.api.auth`: 401)."""
    serving: Serving = request.app.state.serving
    check_api_key(request.headers.get("authorization"), serving.settings)
    return serving


async def authorized(request: Request) -> Serving:
    """Dependency of a route that reads its own body (KServe v2: JSON or binary tensors): the
    bearer token, then the registry and settings."""
    return _serving(request)


async def json_inference(request: Request) -> Serving:
    """Dependency of the JSON inference routes: the bearer token (401), a body declared JSON
    (415, `service.api.media_type`), then the registry and settings; both checks come before
    the body is validated."""
    serving = _serving(request)
    check_json(request.headers.get("content-type"))
    return serving


SettingsDep = Annotated[Settings, Depends(get_settings)]
RegistryDep = Annotated[ModelRegistry, Depends(get_registry)]
AuthorizedDep = Annotated[Serving, Depends(authorized)]
JsonInferenceDep = Annotated[Serving, Depends(json_inference)]
