"""Inference routes take JSON only: another (or no) `Content-Type` gets a 415 with the error body.

Without this FastAPI would skip parsing a `text/plain` or form body and answer a confusing 422.
The routes that read their body by hand decode its JSON with `load_json`.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException

from service.core.errors import InvalidInput


def media_type(content_type: str | None) -> str:
    """The media type of a `Content-Type` value, parameters (charset) aside, lower case."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_json(content_type: str | None) -> bool:
    """`application/json` or any `application/*+json`, parameters (charset) aside."""
    kind = media_type(content_type)
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


def check_json(content_type: str | None) -> None:
    """415 unless the body is declared JSON (the inference routes' dependency,
    `service.api.routes.deps.json_inference`)."""
    if not is_json(content_type):
        raise HTTPException(415, "the body must be JSON (Content-Type: application/json)")


def load_json(raw: bytes) -> Any:
    """A request body's JSON value; `InvalidInput` when it is not JSON or is nested too deep."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidInput("the request body is not valid JSON") from None
    except RecursionError:
        raise InvalidInput("the request body is JSON nested too deep") from None
