"""uvicorn's options for the server's settings, importable without the app: the `--workers`
supervisor process runs no app and imports only this (the worker processes import the rest)."""

from __future__ import annotations

import math
from typing import Any

from service.core.settings import Settings

PROTOCOL = "service.process.http:GuardedProtocol"  # the import path, for uvicorn's worker processes


def server_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of `uvicorn.Config` (or `uvicorn.run`) for `settings`, but the HTTP
    protocol (`service.process.http.uvicorn_options` adds it)."""
    return {
        "host": settings.host,
        "port": settings.port,
        "lifespan": "on",
        "timeout_keep_alive": max(1, math.ceil(settings.keep_alive_timeout_s)),
        "timeout_graceful_shutdown": math.ceil(settings.drain_timeout_s),
        "log_config": None,  # keep the logging set up by `attnserve --log-level --log-format`
        "access_log": False,  # the app logs each request's line, with its id (service.api.request_id)
    }
