"""The server's log lines: text or one JSON object per line, each record logged while a request
is handled carrying that request's id, and one access line per HTTP request.

`configure(level, log_format)` sets the root logger up once per process (`attnserve --log-level
--log-format`; a `--workers` process reads both from its environment). `REQUEST_ID` holds the id
of the request whose task is running (the app's outermost middleware sets it); a filter on the handler
copies it onto every record as `request_id`, so an error logged by a route names the request the
client can quote from its `X-Request-ID` header. `ACCESS` is the access lines' logger: its records
carry `method`, `path`, `status`, `duration_ms`, `client` and, for an inference route, `model`.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import IO, Any

FORMATS = ("text", "json")
FORMAT_VARIABLE = "ATTNSERVE_LOG_FORMAT"  # the format when `--log-format` is not given
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# the record attributes a JSON line carries besides time, level, logger and message
FIELDS = ("request_id", "method", "path", "status", "duration_ms", "client", "model")

REQUEST_ID: ContextVar[str | None] = ContextVar("attnserve_request_id", default=None)
ACCESS = logging.getLogger("attnserve.access")


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id` to the running request's id where the record has none."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """`TEXT_FORMAT`, and ` request_id=<id>` after the message of a record logged while a
    request was handled (the access line names it in its message already)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        identity = getattr(record, "request_id", None)
        return f"{line} request_id={identity}" if identity and record.name != ACCESS.name else line


class JsonFormatter(logging.Formatter):
    """One JSON object per record: `time` (UTC, ISO 8601 with milliseconds), `level`, `logger`,
    `message`, the `FIELDS` the record has, and `exception` (the traceback) when it has one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                entry[field] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def make_handler(log_format: str = "text", stream: IO[str] | None = None) -> logging.Handler:
    """A handler writing `log_format` lines ("text" or "json") to `stream` (standard error by
    default), each record with the running request's id."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    return handler


def configure(level: str = "INFO", log_format: str = "text", stream: IO[str] | None = None) -> None:
    """The root logger at `level` with `make_handler(log_format, stream)`, as `logging.basicConfig`
    sets it up: nothing changes when the root logger has handlers already."""
    logging.basicConfig(level=level.upper(), handlers=[make_handler(log_format, stream)])


def current_format() -> str:
    """The format of the root logger's lines: "json" when a handler writes JSON, else "text"."""
    handlers = logging.getLogger().handlers
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in handlers) else "text"
