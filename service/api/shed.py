"""Refusing a generation request before its body is read, when every model of its task would
refuse it anyway (`BatcherPool.out_of_reach`: the queue full, or even one row not done within
the deadline at the rate the model is finishing rows): 429 with `Retry-After` and the error
body, counted `rejected_total{reason="queue_full"|"expected_wait"}`. The deadline is the
`X-Request-Timeout-Ms` header's when given, else `request_timeout_s`. With an API key set, a
request without the right bearer token is not shed: the route answers its 401.

An overloaded server spends on such a request what the HTTP layer costs, not the parsing,
validation and tokenization of its body, and keeps its cores for the requests it can serve.
`Shedder` makes the decision and builds the answer; two places apply it:

- `ShedMiddleware`, the outermost of the app's own middlewares, for any ASGI server;
- the server's protocol (`service.process.http.Guards`, on httptools' parser), which finds the
  `Shedder` in the lifespan state under `SHED_STATE` and answers from the parser's callback
  without starting the ASGI app at all (no task, no middleware chain), counting the request in
  `requests_total` and `request_duration_seconds` itself; a request it lets through carries
  `SHED_CHECKED` in its scope, and the middleware does not decide again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.auth import check_api_key
from service.api.deadline import HEADER as TIMEOUT_HEADER
from service.api.deadline import header_ms
from service.core.errors import Unauthorized
from service.core.registry import ModelRegistry
from service.core.settings import Settings
from service.observability import metrics

SHED_PATHS = {"/v1/translate": "translate", "/v1/summarize": "summarize"}  # route -> task
SHED_STATE = "attnserve.shed"  # the lifespan state's key of the app's `Shedder`
SHED_CHECKED = "attnserve.shed_checked"  # scope key: the server's protocol let the request through
_TIMEOUT_HEADER = TIMEOUT_HEADER.lower().encode("latin-1")


@dataclass(frozen=True)
class Refusal:
    """A 429 decided before the body was read: the route (the path, a route template here),
    the model counted, and the response's parts."""

    route: str
    model: str
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class Shedder:
    """Whether to refuse a request now, from its method, path and headers alone."""

    def __init__(self, registry: ModelRegistry, settings: Settings) -> None:
        self.registry = registry
        self.settings = settings
        retry_after = str(settings.retry_after_s).encode("ascii")
        self._headers = [(b"content-type", b"application/json"), (b"retry-after", retry_after)]

    def refusal(self, scope: Scope) -> Refusal | None:
        """The 429 for an HTTP `scope` that every model of its task would refuse (counted in
        `rejected_total`), else None. A draining model is left to the route (503)."""
        task = SHED_PATHS.get(scope.get("path", ""))
        if task is None or scope.get("method") != "POST":
            return None
        shed = self._shed(task, scope)
        if shed is None or shed[1] == "draining":
            return None
        model, reason = shed
        if self.settings.api_key is not None and not self._authorized(scope):
            return None
        metrics.REJECTED_TOTAL.labels(model, reason).inc()
        message = ("the queue is full" if reason == "queue_full" else
                   "the request would not be done within its deadline")
        body = json.dumps({"error": f"every {task} model is overloaded ({message}); retry later",
                           "error_type": "overloaded"}).encode()
        headers = [*self._headers, (b"content-length", str(len(body)).encode("ascii"))]
        return Refusal(scope["path"], model, 429, headers, body)

    def _authorized(self, scope: Scope) -> bool:
        authorization = next((value.decode("latin-1") for name, value in scope.get("headers", [])
                              if name.lower() == b"authorization"), None)
        try:
            check_api_key(authorization, self.settings)
        except Unauthorized:
            return False
        return True

    def _shed(self, task: str, scope: Scope) -> tuple[str, str] | None:
        """(the task's first model, why it would refuse) when every model of `task` would
        refuse a one-row request, else None."""
        budget_s = self.settings.request_timeout_s
        for name, value in scope.get("headers", []):
            if name.lower() == _TIMEOUT_HEADER:
                asked_ms = header_ms(value.decode("latin-1"))  # None: 422 from the route
                if asked_ms is not None:
                    budget_s = min(budget_s, asked_ms / 1000)
        entries = [e for e in self.registry.entries
                   if e.task == task and e.state == "ready" and e.batcher is not None]
        reasons = [e.batcher.out_of_reach(budget_s) for e in entries if e.batcher is not None]
        if not reasons or not all(reasons):
            return None
        return entries[0].name, str(reasons[0])


class ShedMiddleware:
    """`Shedder`'s refusals as ASGI middleware (the module's docstring)."""

    def __init__(self, app: ASGIApp, shedder: Shedder) -> None:
        self.app = app
        self.shedder = shedder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        checked = scope["type"] != "http" or scope.get(SHED_CHECKED, False)
        refusal = None if checked else self.shedder.refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["model"] = refusal.model
        scope.setdefault("state", {}).update(route=refusal.route, model=refusal.model)
        await send({"type": "http.response.start", "status": refusal.status,
                    "headers": refusal.headers})
        await send({"type": "http.response.body", "body": refusal.body})
