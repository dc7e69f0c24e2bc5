"""Fixtures of the service tests: an app over fake models, served in-process over httpx."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from service.api.app import create_app
from service.core.settings import Settings
from tests.service.fakes import FakeLoader, FakeModel, write_models

MODELS = {"translate-en-it": "translate", "summarize-en": "summarize"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    """A models folder with a fake translate and a fake summarize model."""
    return write_models(tmp_path / "models", MODELS)


@pytest.fixture
def fake_model() -> FakeModel:
    return FakeModel()


AppFactory = Callable[..., FastAPI]


@pytest.fixture
def make_app(models_dir: Path, fake_model: FakeModel) -> AppFactory:
    """`make_app(loader=None, **settings)`: an app over the fake models."""

    def make(loader: FakeLoader | None = None, **settings: Any) -> FastAPI:
        settings.setdefault("models_dir", models_dir)
        settings.setdefault("batch_workers", 1)  # one batcher: the tests reason about its batches
        return create_app(
            Settings(**settings),
            loader=loader or FakeLoader(),
            generator=lambda runtime: fake_model.generate,
        )

    return make


@asynccontextmanager
async def serving(app: FastAPI, wait_ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan and give an httpx client talking to it in-process."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            if wait_ready:
                await wait_until_ready(client)
            yield client


async def wait_until_ready(client: httpx.AsyncClient, timeout_s: float = 30) -> None:
    """Poll `/health/ready` until 200."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (await client.get("/health/ready")).status_code != 200:
        assert loop.time() < deadline, "the app did not turn ready"
        await asyncio.sleep(0.01)


async def wait_until_settled(client: httpx.AsyncClient, timeout_s: float = 30) -> dict[str, Any]:
    """Poll `/v1/models` until no model is still loading; the model cards by name."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        cards = {c["name"]: c for c in (await client.get("/v1/models")).json()["models"]}
        if all(c["state"] != "loading" for c in cards.values()) or loop.time() >= deadline:
            return cards
        await asyncio.sleep(0.01)


def tiny_settings(models_dir: Path, **overrides: Any) -> Settings:
    """Settings to serve the tiny repository: CPU, one thread, one batcher, the fp32 variant (equal
    to PyTorch)."""
    options: dict[str, Any] = {"models_dir": models_dir, "providers": ("CPUExecutionProvider",),
                               "threads": 1, "batch_workers": 1, "variant": "fp32", **overrides}
    return Settings(**options)


@pytest.fixture(scope="module")
def served_tiny_models(tiny_model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder holding a copy of the tiny repository (as `models/<name>/`)."""
    import shutil

    root = tmp_path_factory.mktemp("served-models")
    shutil.copytree(tiny_model_repository, root / tiny_model_repository.name)
    return root


@pytest.fixture(scope="module")
def tiny_url(served_tiny_models: Path) -> Iterator[str]:
    """The real app over the tiny model (batches wait at most 20 ms), on a loopback port, for a
    test module's protocol tests."""
    from tests.service.live_server import serve, wait_until_ready

    with serve(create_app(tiny_settings(served_tiny_models, max_wait_ms=20))) as url:
        wait_until_ready(url)
        yield url
