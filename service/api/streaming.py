"""Server-Sent Events for `"stream": true` on `/v1/translate` and `/v1/summarize` (one text).

The row is admitted into the batcher before the response starts, so overload, bad input and
unknown models are ordinary JSON errors. Then the body (`text/event-stream`) is one
`data: {json}` event per generated token, then a final one:

    data: {"index": 0, "token": {"id": 9, "piece": "▁ciao"}, "delta": "ciao", "text": "ciao"}
    ...
    data: {"done": true, "model": "...", "delta": "", "output": {...}, "usage": {...}, "timing": {...}}

`text` is the detokenized output so far and `delta` what it adds to the text sent before, so
the deltas of all events (the final one included) concatenate to the output. A text that a
translation model splits into several rows (`service.api.documents`) streams its rows in order:
they decode together, and the tokens of a row wait until the rows before it have ended; the
whitespace between two rows comes in the delta of the next row's first event (the text's
leading whitespace in the first event, its trailing whitespace in the final one), and `index`
counts the tokens of the whole output. Greedy decoding
streams each token as the worker thread decodes it (`RowHooks.on_token`, handed to the event
loop with `call_soon_threadsafe`); beam search streams the tokens of the final hypothesis once
it is chosen. With `return_alignment`, the final event's output carries the word alignment
(one teacher-forced pass once the row finished, in the model's worker thread); with
`return_scores` or `num_hypotheses`, its scores and hypotheses (token events carry none). The
final event's `timing` is the request's stages in milliseconds, as a JSON answer's `Server-Timing`
header gives them (`service.observability.timing`). A
target prefix's tokens are streamed first, as the decoder is forced through them. A failure after
the stream started is one last event with the error body
(`{"error": ..., "error_type": ...}`). When the client goes away, the row is cancelled: it
leaves the queue, or the running batch at the next decoder step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from fastapi.responses import StreamingResponse
from starlette.types import Receive

from service.api import pipeline
from service.api.deadline import Deadline
from service.api.detokenize import Deltas
from service.api.pipeline import Prepared
from service.batching.batcher import Generated
from service.core.errors import DeadlineExceeded, InternalError, ServiceError
from service.core.settings import Settings
from service.generation import attention_maps
from service.observability import metrics
from service.observability.timing import RequestTiming

logger = logging.getLogger(__name__)

MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: dict[str, Any]) -> bytes:
    """One SSE event carrying `data` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class EventWriter(Protocol[T_co]):
    """What a stream is written as, from its events' data: whatever opens it, each token, the
    end (or an error after it started); an empty write (b"", None) sends nothing."""

    def opening(self) -> T_co | None: ...

    def token(self, data: dict[str, Any]) -> T_co | None: ...

    def final(self, data: dict[str, Any]) -> T_co: ...

    def error(self, message: str, error_type: str) -> T_co: ...


class Events:
    """How a stream's events are written: by default the server's own, one `event` per token
    event, then the final event (or an error's); a protocol with events of its own
    (`service.api.routes.openai`) overrides them from the same data."""

    def opening(self) -> bytes:
        """What the stream starts with, before its first token."""
        return b""

    def token(self, data: dict[str, Any]) -> bytes:
        """A token's event (`index`, `token`, `delta`, `text`)."""
        return event(data)

    def final(self, data: dict[str, Any]) -> bytes:
        """The final event (`done`, `model`, `delta`, `output`, `usage`, and `timing` when kept)."""
        return event(data)

    def error(self, message: str, error_type: str) -> bytes:
        """The last event of a stream that failed after it started."""
        return event({"error": message, "error_type": error_type})


def stream(
    prepared: Prepared, receive: Receive, settings: Settings, deadline: Deadline | None = None,
    alignment: bool = False, timing: RequestTiming | None = None, events: Events | None = None,
) -> StreamingResponse:
    """Admit the request's rows (of its one text; raising `Overloaded`/`NotReady` now) and
    stream them, within `deadline` (default `request_timeout_s`); with `alignment` (one row:
    the route keeps the text whole), the final event's output has its word alignment; with
    `timing`, the final event has the request's stages; written by `events` (default the
    server's own)."""
    body = admit(prepared, settings, deadline, alignment, timing, events or Events(), receive)
    return StreamingResponse(body, media_type=MEDIA_TYPE, headers=HEADERS)


def admit(
    prepared: Prepared, settings: Settings, deadline: Deadline | None, alignment: bool,
    timing: RequestTiming | None, events: EventWriter[T], receive: Receive | None = None,
) -> AsyncIterator[T]:
    """`stream`'s work for any transport: the rows admitted now, then an iterator of what
    `events` writes of them (its empty writes left out); with `receive`, it ends once the HTTP
    client has gone (without, when the iterator is closed or its task cancelled); either way
    the rows leave the batch."""
    batcher = prepared.entry.batcher
    assert batcher is not None and len(prepared.texts) == 1
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue[int]] = [asyncio.Queue() for _ in prepared.sources]
    futures = batcher.enqueue(
        prepared.sources, prepared.beam_size, prepared.max_new_tokens,
        hooks=[prepared.options.row_hooks(row, on_token=_threadsafe_put(loop, queue))
               for row, queue in enumerate(queues)],
        deadline=deadline.at if deadline is not None else None, timing=timing,
    )
    budget_s = deadline.budget_s if deadline is not None else settings.request_timeout_s
    return _events(prepared, list(zip(futures, queues, strict=True)), receive, budget_s,
                   settings if alignment else None, timing, events)


def _threadsafe_put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[int]) -> Callable[[int], None]:
    def put(token: int) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed (shutdown)
            loop.call_soon_threadsafe(queue.put_nowait, token)

    return put


class _Text:
    """The detokenized text so far (the rows ended, with their separators, then the tokens of
    the current row) and what each token adds to it."""

    def __init__(self, prepared: Prepared) -> None:
        self.tokenizer = prepared.runtime.tokenizer
        [self.document] = prepared.documents
        self.done = self.document.separators[0]  # the rows ended, each with the separator after it
        self.ids: list[int] = []  # the current row's tokens
        self.count = 0  # tokens of all rows
        self.deltas = Deltas()  # what was sent: the concatenation of the deltas

    def add(self, token: int) -> dict[str, Any]:
        self.ids.append(token)
        self.count += 1
        text = self.done + self.tokenizer.decode(self.ids)
        return {"index": self.count - 1,
                "token": {"id": token, "piece": self.tokenizer.pieces([token])[0]},
                "delta": self.deltas.delta(text), "text": text}

    def end_row(self, row: int, tokens: list[int]) -> None:
        """Row `row` ended with `tokens`: the next tokens belong to the next row."""
        self.done += self.tokenizer.decode(tokens) + self.document.separators[row + 1]
        self.ids = []

    @property
    def sent(self) -> str:
        """The text sent so far."""
        return self.deltas.sent


async def _events(
    prepared: Prepared,
    rows: list[tuple[asyncio.Future[Generated], asyncio.Queue[int]]],
    receive: Receive | None,
    budget_s: float,
    align_settings: Settings | None,
    timing: RequestTiming | None,
    events: EventWriter[T],
) -> AsyncIterator[T]:
    """The events of one streamed row, written by `events`; with `align_settings`, the final
    output aligned; with `timing`, the request's stages in the final event."""
    entry = prepared.entry
    batcher = entry.batcher
    assert batcher is not None
    text = _Text(prepared)
    # the HTTP client's leaving; another transport's ends the stream by cancelling it
    gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else _never()
    next_token: asyncio.Future[int] | None = None
    results: list[Generated] = []
    try:
        opening = events.opening()
        if opening:
            yield opening
        for row, (future, tokens) in enumerate(rows):
            while True:
                if next_token is None:
                    next_token = asyncio.ensure_future(tokens.get())
                remaining = budget_s - (time.perf_counter() - prepared.started)
                waiting: set[asyncio.Future[Any]] = {next_token, future, gone}
                done, _ = await asyncio.wait(
                    waiting, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED
                )
                if gone in done:
                    return  # `finally` cancels the rows
                if next_token in done:
                    if chunk := events.token(text.add(next_token.result())):
                        yield chunk
                    next_token = None
                    continue
                if future in done:
                    break
                metrics.REJECTED_TOTAL.labels(entry.name, "deadline").inc()
                raise DeadlineExceeded(
                    f"no result within the deadline of {budget_s:g}s"
                )
            if next_token is not None:
                next_token.cancel()
                next_token = None
            while not tokens.empty():  # sent by the worker before the batch ended
                if chunk := events.token(text.add(tokens.get_nowait())):
                    yield chunk
            result = future.result()
            for token in result.tokens[len(text.ids):]:  # beam search: the final hypothesis
                if chunk := events.token(text.add(token)):
                    yield chunk
            text.end_row(row, list(result.tokens))
            results.append(result)
        extras: list[dict[str, Any]] = [{} for _ in prepared.texts]
        if align_settings is not None:  # one text, one row (`whole_texts`)
            [extras[0]["alignment"]] = await pipeline.within_deadline(
                batcher.run(attention_maps.word_alignments, prepared.runtime, prepared.texts,
                            prepared.sources, [list(results[0].tokens)]),
                entry, prepared.started, align_settings, budget_s=budget_s,
            )
        if prepared.options.per_text:  # one text, one row (`whole_texts`)
            extras[0].update(prepared.options.extras(prepared.runtime, results[0]))
        [out] = pipeline.outputs(prepared, results, extras)
        final = {"done": True, "model": entry.name, "delta": out.text[len(text.sent):]
                 if out.text.startswith(text.sent) else "",
                 "output": out.model_dump(exclude_none=True),
                 "usage": pipeline.usage([out]).model_dump()}
        if timing is not None:
            final["timing"] = timing.milliseconds(time.perf_counter())
        yield events.final(final)
    except ServiceError as error:
        yield events.error(error.message, error.error_type)
    except Exception:
        logger.exception("model %s: a streamed request failed", entry.name)
        yield events.error("internal error", InternalError.error_type)
    finally:
        gone.cancel()
        if next_token is not None:
            next_token.cancel()
        for future, _ in rows:
            batcher.cancel(future)  # nothing when the row finished; else it leaves the batch


def _never() -> asyncio.Future[Any]:
    """A future of the running loop that nothing completes."""
    return asyncio.get_running_loop().create_future()


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
