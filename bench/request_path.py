"""What the app's request path costs the event loop, apart from HTTP parsing and the engine.

    python -m bench.request_path --models models --data-dir data --requests 3000 --concurrency 64 \
        --out bench/results/request-path/app.json

The app (`service.api.app.create_app`, the models of `--models` at the server's defaults) is
called in this process as uvicorn calls it, through ASGI, with no socket: `--concurrency`
clients each send `POST /v1/<task>` with one test sentence, until `--requests` have been
answered. The main thread runs the event loop (the routes, the middlewares, the scheduler) and
the clients; the batch workers run the models in their own threads. Its CPU seconds per request
(`main_ms_per_request`) are what the app's Python costs the event loop (of which the models'
SentencePiece encoding and decoding, `tokenizer_ms_per_request`); the same clients against
a bare FastAPI route of the same shape (a pydantic body in, a pydantic response out, nothing
else: `floor_ms_per_request`) give what FastAPI itself costs. uvicorn's HTTP parsing and the
sockets are the same for both and left out. `--turns` alternates the two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from bench import machine
from bench.report import emit_json
from bench.stats import timed_calls

Scope = MutableMapping[str, Any]
App = Callable[[Scope, Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]],
               Awaitable[None]]


class _Body(BaseModel):
    text: str


class _Output(BaseModel):
    text: str
    finish_reason: str
    input_tokens: int
    output_tokens: int


class _Response(BaseModel):
    model: str
    outputs: list[_Output]


def bare_app(task: str) -> FastAPI:
    """A FastAPI app whose one route takes a text and answers a response of the service's shape
    without any work: what FastAPI's own routing, validation and serialization cost."""
    app = FastAPI()

    @app.post(f"/v1/{task}", response_model=_Response)
    async def route(body: _Body) -> _Response:
        return _Response(model="bare", outputs=[_Output(text=body.text, finish_reason="eos",
                                                        input_tokens=1, output_tokens=1)])

    return app


async def _request(app: App, path: str, raw: bytes, state: dict[str, Any]) -> int:
    """One POST through the ASGI app as uvicorn would make it; the response's status."""
    scope: Scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000), "state": dict(state),
    }
    sent = asyncio.Event()
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        if not sent.is_set():
            sent.set()
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(int(message["status"]))

    await app(scope, receive, send)
    return status[0]


async def drive(app: FastAPI, path: str, texts: Sequence[str], requests: int, concurrency: int) -> dict[str, Any]:
    """`requests` POSTs of `texts` in turn from `concurrency` clients, the app's lifespan around
    them: the main thread's CPU per request, the wall time per request and the statuses."""
    async with app.router.lifespan_context(app) as state:
        registry = getattr(app.state, "registry", None)
        if registry is not None:  # the models load in the background: wait for them
            await registry.wait_settled()
        bodies = [json.dumps({"text": t}).encode() for t in texts]
        state = dict(state or {})
        for raw in bodies[:concurrency]:  # the first requests: warm-up
            await _request(app, path, raw, state)
        left = list(range(requests))
        statuses: dict[int, int] = {}

        async def client() -> None:
            while left:
                i = left.pop()
                status = await _request(app, path, bodies[i % len(bodies)], state)
                statuses[status] = statuses.get(status, 0) + 1

        tokenizers = [] if registry is None else [e.runtime.tokenizer for e in registry.entries if e.runtime]
        with (timed_calls(tokenizers, "encode_batch", time.thread_time) as encoding,
              timed_calls(tokenizers, "decode", time.thread_time) as decoding):
            cpu, wall = time.thread_time(), time.perf_counter()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    return {"main_ms_per_request": 1000 * cpu / requests, "wall_ms_per_request": 1000 * wall / requests,
            "tokenizer_ms_per_request": 1000 * (encoding[0] + decoding[0]) / requests,
            "statuses": {str(k): v for k, v in sorted(statuses.items())}}


def tokenizer_alone(model_dir: Path, texts: Sequence[str], rounds: int = 3) -> float:
    """CPU milliseconds of the model's SentencePiece encoding and decoding of one text, each text
    of `texts` in turn with nothing else running (median of `rounds` passes)."""
    from model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(model_dir / "tokenizer.model")
    passes = []
    for _ in range(rounds):
        started = time.thread_time()
        for text in texts:
            [ids] = tokenizer.encode_batch([text])
            tokenizer.decode(ids)
        passes.append(1000 * (time.thread_time() - started) / max(len(texts), 1))
    return statistics.median(passes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.request_path", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--model", default="translate-en-it", help="the model whose test sentences are sent")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3, help="app and floor alternating, each this many times")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import uvloop

    from bench.workload import read_lines
    from service.api.app import create_app
    from service.core.settings import Settings
    from service.repository.manifest import read_manifest

    task = read_manifest(args.models / args.model).task
    texts = read_lines(args.data_dir / args.model / "test.src", args.requests)
    path = f"/v1/{task}"
    runs: dict[str, list[dict[str, Any]]] = {"app": [], "floor": []}
    for _ in range(args.turns):
        for name, done in runs.items():
            app = create_app(Settings(models_dir=args.models)) if name == "app" else bare_app(task)
            done.append(uvloop.run(drive(app, path, texts, args.requests, args.concurrency)))
    report = {
        "command": "python -m bench.request_path " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine.describe(), "requests": args.requests, "concurrency": args.concurrency,
        **{f"{name}_main_ms_per_request": statistics.median(r["main_ms_per_request"] for r in rs)
           for name, rs in runs.items()},
        "app_tokenizer_ms_per_request": statistics.median(r["tokenizer_ms_per_request"] for r in runs["app"]),
        "tokenizer_alone_ms_per_request": tokenizer_alone(args.models / args.model, texts),
        "runs": runs,
    }
    emit_json(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
