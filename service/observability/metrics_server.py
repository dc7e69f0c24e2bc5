"""`/metrics` on its own port (`metrics_port`), so the inference port need not expose it.

prometheus-client's own HTTP server runs in a daemon thread over `service.observability.metrics.REGISTRY`;
it answers any path with the exposition (Prometheus scrapes `/metrics`).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import start_http_server

from service.observability.metrics import REGISTRY

logger = logging.getLogger(__name__)


def start_metrics_server(port: int, host: str = "127.0.0.1") -> Any:
    """Serve the metrics on `host:port` in a daemon thread; returns the HTTP server
    (`.server_address` gives the bound port when `port` is 0; `.shutdown()` stops it)."""
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    logger.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
