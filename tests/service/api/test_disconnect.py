"""`unless_disconnected`: the work's outcome is always collected, even when the wait around it
is cancelled (a deadline) in the same turn as the work fails."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from service.api.disconnect import unless_disconnected
from service.core.errors import DeadlineExceeded


class _Connected:
    """A request whose client never leaves."""

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}


def test_work_failing_as_its_wait_is_cancelled_leaves_no_unretrieved_exception() -> None:
    reported: list[dict[str, Any]] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        outcome: asyncio.Future[list[int]] = loop.create_future()

        async def work() -> list[int]:
            return await outcome

        waiting = asyncio.ensure_future(unless_disconnected(_Connected(), work(), "m"))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)  # the work and the watcher are waiting
        outcome.set_exception(DeadlineExceeded("the deadline passed while the request was queued"))
        waiting.cancel()  # the request's own deadline, in the same turn
        try:
            await waiting
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    gc.collect()
    assert not [c for c in reported if "never retrieved" in str(c.get("message", ""))], reported
