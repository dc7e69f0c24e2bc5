"""Drop work whose client went away: watch the connection while a request waits for its batch.

`unless_disconnected` awaits the work and, beside it, the request's next ASGI message: once
the body has been read, the server sends `http.disconnect` only when the client closes the
connection (or after the response). If the client goes first, the work is cancelled (the
batcher skips cancelled rows, so they never reach the model), `rejected_total{reason=
"disconnected"}` is counted and `ClientDisconnected` raised (a 499 nobody reads). Nothing polls:
a waiting request costs the event loop nothing until one of the two ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from service.core.errors import ClientDisconnected
from service.observability import metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T], model: str,
                              timeout_s: float | None = None) -> T:
    """`await work`, cancelled with `ClientDisconnected` as soon as the client is gone, or with
    `TimeoutError` after `timeout_s` (one wait for both: no task more for the timeout)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.wait({task})  # its rows cancelled (the batcher's `cancel`) before the answer
        if not done:
            raise TimeoutError
        metrics.REJECTED_TOTAL.labels(model, "disconnected").inc()
        logger.info("model %s: client gone, dropped its queued request", model)
        raise ClientDisconnected("the client closed the connection")
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
            elif not pending.cancelled():
                pending.exception()  # retrieved: the work may have failed as this wait was cancelled


async def _until_disconnect(request: Request) -> None:
    """Return when the server reports the client gone (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
