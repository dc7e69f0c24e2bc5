"""Dependencies of the routes: the settings and the model registry of the running app.

Both are `async def`: FastAPI runs a plain `def` dependency in its thread pool, two thread
hops per request for an attribute lookup (and a wait for a core when the model's threads
hold them all)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

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


SettingsDep = Annotated[Settings, Depends(get_settings)]
RegistryDep = Annotated[ModelRegistry, Depends(get_registry)]
