"""Optional bearer-token auth (`ATTNSERVE_API_KEY`).

With no key configured every request passes. With one, a request needs the header
`Authorization: Bearer <key>`; the comparison is constant-time (`hmac.compare_digest`) and a
missing or wrong token gets a 401 with the error body and `WWW-Authenticate: Bearer`.

The inference routes need it (their dependency, `service.api.routes.deps`); so do the API's descriptions -- `/docs`,
`/redoc`, `/openapi.json`, `GET /v1/models`, the KServe model metadata -- unless
`public_metadata` opens them (`require_api_key_for_metadata`). Probes, metrics and the page
stay open.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from service.core.errors import Unauthorized
from service.core.settings import Settings

SCHEME = "bearer"


def check_api_key(authorization: str | None, settings: Settings) -> None:
    """Raise `Unauthorized` unless `authorization` carries the configured key (if any)."""
    if settings.api_key is None:
        return
    expected = settings.api_key.get_secret_value().encode("utf-8")
    scheme, _, token = (authorization or "").partition(" ")
    given = token.strip().encode("utf-8", "surrogateescape")
    # Compared even when the scheme is wrong, so the time does not tell which part failed.
    matches = hmac.compare_digest(given, expected)
    if scheme.lower() != SCHEME or not matches:
        raise Unauthorized("a valid bearer token is required")


async def require_api_key_for_metadata(request: Request) -> None:
    """Dependency of the docs and the model listing: the key, unless `public_metadata`."""
    settings: Settings = request.app.state.settings
    if not settings.public_metadata:
        check_api_key(request.headers.get("authorization"), settings)
