"""Drop work whose client went away: poll the connection while a request waits for its batch.

`unless_disconnected` awaits the work and, every `poll_s`, asks the server whether the client
disconnected; if it did, it cancels the work (the batcher skips cancelled rows, so they never
reach the model), counts `rejected_total{reason="disconnected"}` and raises
`ClientDisconnected` (a 499 nobody reads).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from service import metrics
from service.errors import ClientDisconnected

logger = logging.getLogger(__name__)

T = TypeVar("T")

POLL_S = 0.05


async def unless_disconnected(
    request: Request, work: Awaitable[T], model: str, poll_s: float = POLL_S
) -> T:
    """`await work`, cancelled with `ClientDisconnected` as soon as the client is gone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                metrics.REJECTED_TOTAL.labels(model, "disconnected").inc()
                logger.info("model %s: client gone, dropped its queued request", model)
                raise ClientDisconnected("the client closed the connection")
    finally:
        if not task.done():
            task.cancel()
