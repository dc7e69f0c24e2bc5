"""Several server processes on one socket (`--workers N`), each restarted if it dies.

uvicorn's process supervisor binds the socket once, spawns N worker processes that accept
on it, and replaces any worker that exits or is killed (only that worker's in-flight requests
fail). Each worker builds its own app from the environment (`app_from_environment`): the
parent writes the effective settings into `ATTNSERVE_*` variables before spawning. Every
worker loads every model and has its own batcher; their metrics add up through files in a
folder the supervisor makes (prometheus-client's multiprocess mode,
`service.observability.metrics`), so any worker's `/metrics` reports all of them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from service.core.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI

ENV_PREFIX = "ATTNSERVE_"
LOG_LEVEL_VARIABLE = "ATTNSERVE_LOG_LEVEL"  # the parent's `--log-level`, for the workers


def settings_environment(settings: Settings) -> dict[str, str]:
    """`ATTNSERVE_*` variables that rebuild `settings` in a worker (the API key included)."""
    environment = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if name == "api_key":
            value = settings.api_key.get_secret_value() if settings.api_key else None
        elif isinstance(value, tuple | list):
            value = ",".join(str(part) for part in value)
        elif isinstance(value, bool):
            value = json.dumps(value)
        environment[ENV_PREFIX + name.upper()] = str(value)
    return environment


def app_from_environment() -> FastAPI:
    """The app of one worker, with the settings its parent wrote into the environment."""
    from service.api.app import create_app

    if not logging.getLogger().handlers:  # a spawned worker: logging as `attnserve` sets it
        logging.basicConfig(level=os.environ.get(LOG_LEVEL_VARIABLE, "INFO").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return create_app(Settings())


def run_workers(settings: Settings, environ: Mapping[str, str] | None = None) -> None:
    """Serve with `settings.workers` processes until SIGTERM or SIGINT (which drains them)."""
    import uvicorn

    os.environ.update(environ if environ is not None else settings_environment(settings))
    os.environ[LOG_LEVEL_VARIABLE] = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    # the supervisor runs no app: uvicorn's options without the app's modules (numpy, onnxruntime)
    from service.observability.metrics import MULTIPROCESS_DIR
    from service.process.uvicorn_config import PROTOCOL, server_options

    options: dict[str, Any] = {**server_options(settings), "http": PROTOCOL,
                               "workers": settings.workers, "factory": True}
    given = os.environ.get(MULTIPROCESS_DIR)  # the workers' metrics add up in files there
    directory = given or tempfile.mkdtemp(prefix="attnserve-metrics-")
    os.environ[MULTIPROCESS_DIR] = directory
    try:
        uvicorn.run("service.process.workers:app_from_environment", **options)
    finally:
        if not given:
            shutil.rmtree(directory, ignore_errors=True)
