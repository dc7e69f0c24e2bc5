"""One generation request, whatever the protocol: texts -> token ids -> batcher -> texts.

Shared by `/v1/translate` and `/v1/summarize` (plain and streamed, `service.api.streaming`) and by
the KServe v2 infer route (`service.api.open_inference`): the configured limits, tokenization within the
model's limits, the token budget, admission into the model's batcher under the request's
deadline, and detokenization into `Output`s with their usage.

A text is one row, except on translation models, which split a text into sentences when it holds
several or exceeds the model's window (`service.api.documents`); the rows of all the texts of a
request go to the batcher together, and each text's output joins its rows' outputs. A text
longer than the window is otherwise refused, or, with `truncate`, cut to its first tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from service.api import documents
from service.api.deadline import Deadline
from service.api.decode_options import DecodeOptions
from service.api.disconnect import unless_disconnected
from service.api.documents import Document
from service.api.schemas import Output, Usage
from service.batching.batcher import Generated
from service.core.errors import DeadlineExceeded, InvalidInput
from service.core.registry import ModelEntry
from service.core.settings import Settings
from service.observability import metrics
from service.observability.timing import RequestTiming
from service.runtime.protocol import Runtime

T = TypeVar("T")

TRANSLATE = "translate"  # the task whose texts are split into sentences


@dataclass(frozen=True)
class Prepared:
    """A request checked and tokenized, ready for the batcher: its texts' rows, in order."""

    entry: ModelEntry
    texts: list[str]
    sources: list[list[int]]  # token ids of each row, ending with EOS: each text's rows in turn
    beam_size: int
    max_new_tokens: int
    started: float  # time.perf_counter() when the request arrived
    documents: list[Document]  # each text's rows and layout
    truncated: list[bool] | None = None  # with `truncate`: whether each text was cut
    options: DecodeOptions = field(default_factory=DecodeOptions)  # scores, hypotheses, target prefix

    @property
    def runtime(self) -> Runtime:
        """The model's runtime (ready: resolved by the registry)."""
        assert self.entry.runtime is not None
        return self.entry.runtime

    def rows(self) -> list[range]:
        """The indices in `sources` of each text's rows."""
        ranges, start = [], 0
        for document in self.documents:
            ranges.append(range(start, start + document.rows))
            start += document.rows
        return ranges


def prepare(
    entry: ModelEntry,
    texts: list[str],
    beam_size: int,
    max_new_tokens: int | None,
    settings: Settings,
    where: Sequence[str] | None = None,
    started: float | None = None,
    truncate: int | bool | None = None,
    whole_texts: bool = False,
) -> Prepared:
    """Check the texts and options against the limits and tokenize them (`InvalidInput`).

    `where` names each text in error messages (default `texts.<i>`). A translation model's texts
    are split into rows (`service.api.documents`) unless `whole_texts`; `truncate` (other
    tasks) keeps a text's first tokens (`true`: as many as the model takes) instead of refusing
    a longer text.
    """
    assert entry.runtime is not None and entry.batcher is not None
    runtime = entry.runtime
    names = list(where) if where is not None else [f"texts.{i}" for i in range(len(texts))]
    translating = runtime.task == TRANSLATE
    if translating and truncate not in (None, False):
        raise InvalidInput("truncate: translation splits long texts into sentences; "
                           "truncate is for summarization")
    split = translating and not whole_texts
    check_texts(texts, names, settings,
                settings.max_document_chars if split else settings.max_text_chars)
    limit = max_new_tokens_for(max_new_tokens, runtime, settings)
    started = time.perf_counter() if started is None else started
    if not split:
        sources, truncated = encode(runtime, texts, names, settings, truncate)
        whole = [documents.whole(text, source[:-1])
                 for text, source in zip(texts, sources, strict=True)]
        return Prepared(entry, list(texts), sources, beam_size, limit, started, whole,
                        truncated if truncate not in (None, False) else None)
    window = source_limit(runtime, settings)
    language = source_language(runtime)
    # at most what one batch worker's queue holds: more would be a 429 that no retry clears
    most = min(settings.max_segments, entry.batcher.limits.max_queue_size)
    docs: list[Document] = []
    rows = 0
    for text, name in zip(texts, names, strict=True):
        docs.append(documents.split(text, runtime.tokenizer, window, language, name))
        rows += docs[-1].rows
        if rows > most:
            counted = f"{rows} sentences" if len(docs) == len(texts) else f"over {most} sentences"
            raise InvalidInput(f"{names[0] if len(texts) == 1 else 'texts'}: {counted} "
                               f"(rows for the model); at most {most} in one request")
    eos = runtime.tokenizer.eos_id
    sources = [[*ids, eos] for document in docs for ids in document.ids]
    return Prepared(entry, list(texts), sources, beam_size, limit, started, docs)


async def generate(
    prepared: Prepared, settings: Settings, deadline: Deadline | None = None,
    request: Request | None = None, timing: RequestTiming | None = None,
) -> list[Generated]:
    """Every row of the request through the batcher, within the request's deadline (default
    `request_timeout_s`); with `request`, dropped as soon as its client goes away; `timing`
    records the rows' passage through the batcher."""
    entry = prepared.entry
    assert entry.batcher is not None
    submitted: Awaitable[list[Generated]] = entry.batcher.submit(
        prepared.sources, prepared.beam_size, prepared.max_new_tokens,
        deadline.at if deadline is not None else None, hooks=prepared.options.hooks(len(prepared.sources)),
        timing=timing,
    )
    return await within_deadline(submitted, entry, prepared.started, settings,
                                 budget_s=deadline.budget_s if deadline is not None else None,
                                 request=request)


def outputs(
    prepared: Prepared, results: Sequence[Generated], extras: Sequence[dict[str, Any]] | None = None
) -> list[Output]:
    """The output of each text: its rows' outputs joined into its layout, "length" when a row
    reached its token limit, and the tokens summed over its rows (each row's source with EOS)."""
    decode = prepared.runtime.tokenizer.decode
    texts = []
    for i, (document, rows) in enumerate(zip(prepared.documents, prepared.rows(), strict=True)):
        extra = dict(extras[i]) if extras is not None else {}
        if prepared.truncated is not None:
            extra["truncated"] = prepared.truncated[i]
        ended = [results[row] for row in rows]
        texts.append(Output(
            text=document.join([decode(result.tokens) for result in ended]),
            finish_reason="length" if any(r.finish_reason == "length" for r in ended) else "eos",
            input_tokens=sum(len(prepared.sources[row]) for row in rows),
            output_tokens=sum(len(result.tokens) for result in ended),
            **extra,
        ))
    return texts


def usage(outputs: Sequence[Output]) -> Usage:
    """Token counts summed over the outputs of a request."""
    return Usage(
        input_tokens=sum(o.input_tokens for o in outputs),
        output_tokens=sum(o.output_tokens for o in outputs),
    )


def attention_runtime(runtime: Any) -> Runtime:
    """The runtime, if it gives attention weights; else 422."""
    if not isinstance(runtime, Runtime):
        raise InvalidInput(f"model {runtime.name!r} does not give attention weights")
    return runtime


async def within_deadline(
    work: Awaitable[T], entry: ModelEntry, started: float, settings: Settings,
    budget_s: float | None = None, request: Request | None = None,
) -> T:
    """`await work`, or `DeadlineExceeded` (504) once the request is `budget_s` old
    (default `request_timeout_s`), whether it was still queued or running; with `request`,
    `ClientDisconnected` as soon as its client goes away (`service.api.disconnect`)."""
    budget_s = settings.request_timeout_s if budget_s is None else budget_s
    remaining = budget_s - (time.perf_counter() - started)
    try:
        if request is not None:
            return await unless_disconnected(request, work, entry.name, timeout_s=max(remaining, 0))
        return await asyncio.wait_for(work, remaining)
    except (TimeoutError, DeadlineExceeded):
        metrics.REJECTED_TOTAL.labels(entry.name, "deadline").inc()
        raise DeadlineExceeded(f"no result within the deadline of {budget_s:g}s") from None


def check_texts(
    texts: list[str], where: Sequence[str], settings: Settings, max_chars: int | None = None
) -> None:
    """The configured count and character limits (`max_chars`, default `max_text_chars`; the
    schema holds only the hard caps)."""
    max_chars = settings.max_text_chars if max_chars is None else max_chars
    if not texts:
        raise InvalidInput("texts: at least one text is needed")
    if len(texts) > settings.max_texts:
        raise InvalidInput(f"texts: {len(texts)} texts; at most {settings.max_texts} allowed")
    for i, text in enumerate(texts):
        if len(text) > max_chars:
            raise InvalidInput(f"{where[i]}: {len(text)} characters; at most {max_chars} allowed")


def source_limit(runtime: Runtime, settings: Settings) -> int:
    """Source tokens of one row, EOS excepted: the model's window, or `max_input_tokens`."""
    limit = runtime.max_source_len - 1  # room for EOS
    if settings.max_input_tokens is not None:
        limit = min(limit, settings.max_input_tokens)
    return limit


def source_language(runtime: Runtime) -> str:
    """The language of the model's sources (its manifest's), for sentence splitting."""
    manifest = getattr(runtime, "manifest", None)
    return str(getattr(manifest, "source_language", None) or "en")


def encode(
    runtime: Runtime, texts: list[str], where: Sequence[str], settings: Settings,
    truncate: int | bool | None = None,
) -> tuple[list[list[int]], list[bool]]:
    """Token ids of each text with EOS appended, within the model's source length, and whether
    `truncate` cut each one. A longer text is refused unless `truncate` keeps its first tokens."""
    tokenizer = runtime.tokenizer
    limit = source_limit(runtime, settings)
    keep = limit
    if truncate is not None and not isinstance(truncate, bool):
        if truncate > limit:
            raise InvalidInput(f"truncate: at most {limit} tokens for model {runtime.name!r}")
        keep = truncate
    cutting = truncate is not None and truncate is not False
    sources, truncated = [], []
    for i, ids in enumerate(tokenizer.encode_batch(texts)):
        if not ids:
            raise InvalidInput(f"{where[i]}: the text has no tokens")
        if len(ids) > limit and not cutting:
            hint = "" if runtime.task == TRANSLATE else " (`truncate` keeps the first ones)"
            raise InvalidInput(f"{where[i]}: {len(ids)} tokens; at most {limit} allowed{hint}")
        truncated.append(cutting and len(ids) > keep)
        sources.append([*(ids[:keep] if cutting else ids), tokenizer.eos_id])
    return sources, truncated


def max_new_tokens_for(asked: int | None, runtime: Runtime, settings: Settings) -> int:
    """The request's token limit, or the server's default, within the model's target length."""
    limit = runtime.max_target_len
    if asked is None:
        return min(settings.default_max_new_tokens or limit, limit)
    if asked > limit:
        raise InvalidInput(f"max_new_tokens: at most {limit} for model {runtime.name!r}")
    return asked
