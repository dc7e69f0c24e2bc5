"""Per-request deadlines: from the `X-Request-Timeout-Ms` header or the body, else the default.

A request's budget is the first of: the body's `timeout_ms`, the header, the server's
`request_timeout_s`; it never exceeds `request_timeout_s` (a client cannot hold the server
longer than configured). The deadline is an instant on `time.perf_counter`, the clock of the
batcher, which fails rows still queued past it without running them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from starlette.requests import Request

from service.core.errors import InvalidInput
from service.core.settings import Settings

HEADER = "X-Request-Timeout-Ms"
MAX_HEADER_CHARS = 12


@dataclass(frozen=True)
class Deadline:
    """When a request must be answered by (`perf_counter` seconds) and its budget."""

    at: float
    budget_s: float

    def remaining(self) -> float:
        """Seconds left (negative once passed)."""
        return self.at - time.perf_counter()

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.remaining() <= 0


def request_deadline(
    request: Request, body_timeout_ms: int | None, settings: Settings, started: float
) -> Deadline:
    """The deadline of `request`, which started at `started` (`perf_counter`).

    Raises `InvalidInput` (422) for a header that is not a positive whole number.
    """
    budget_s = request_budget_s(request, body_timeout_ms, settings)
    return Deadline(at=started + budget_s, budget_s=budget_s)


def request_budget_s(request: Request, body_timeout_ms: int | None, settings: Settings) -> float:
    """The seconds `request` may take: the first of the body's timeout, the header's and
    `request_timeout_s`, and never more than `request_timeout_s` (`InvalidInput` as
    `request_deadline`)."""
    asked_ms = body_timeout_ms if body_timeout_ms is not None else _header_ms(request)
    return within_budget(asked_ms / 1000 if asked_ms is not None else None, settings)


def within_budget(asked_s: float | None, settings: Settings) -> float:
    """The seconds a request asking for `asked_s` (None: nothing asked) may take: at most
    `request_timeout_s`."""
    return settings.request_timeout_s if asked_s is None else min(settings.request_timeout_s, asked_s)


def header_ms(value: str) -> int | None:
    """The milliseconds of an `X-Request-Timeout-Ms` value: a whole number of at most
    `MAX_HEADER_CHARS` digits, at least 1; None for anything else."""
    value = value.strip()
    if not value.isascii() or not value.isdigit() or len(value) > MAX_HEADER_CHARS or int(value) < 1:
        return None
    return int(value)


def _header_ms(request: Request) -> int | None:
    value = request.headers.get(HEADER)
    if value is None:
        return None
    parsed = header_ms(value)
    if parsed is None:
        raise InvalidInput(f"{HEADER}: a whole number of milliseconds, at least 1, is needed")
    return parsed
