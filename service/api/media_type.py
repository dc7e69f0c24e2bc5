"""Inference routes take JSON only: another (or no) `Content-Type` gets a 415 with the error body.

Without this FastAPI would skip parsing a `text/plain` or form body and answer a confusing 422.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException


def is_json(content_type: str | None) -> bool:
    """`application/json` or any `application/*+json`, parameters (charset) aside."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def check_json(content_type: str | None) -> None:
    """415 unless the body is declared JSON (the inference routes' dependency,
    `service.api.routes.deps.json_inference`)."""
    if not is_json(content_type):
        raise HTTPException(415, "the body must be JSON (Content-Type: application/json)")
