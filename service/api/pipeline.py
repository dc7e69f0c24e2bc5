"""One generation request, whatever the protocol: texts -> token ids -> batcher -> texts.

Shared by `/v1/translate` and `/v1/summarize` (plain and streamed, `service.api.streaming`) and by
the KServe v2 infer route (`service.api.open_inference`): the configured limits, tokenization within the
model's limits, the token budget, admission into the model's batcher under the request's
deadline, and detokenization into `Output`s with their usage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from service.api.deadline import Deadline
from service.api.decode_options import DecodeOptions
from service.api.disconnect import unless_disconnected
from service.api.schemas import Output, Usage
from service.batching.batcher import Generated
from service.errors import DeadlineExceeded, InvalidInput
from service.observability import metrics
from service.registry import ModelEntry
from service.runtime.protocol import Runtime
from service.settings import Settings

T = TypeVar("T")


@dataclass(frozen=True)
class Prepared:
    """A request checked and tokenized, ready for the batcher."""

    entry: ModelEntry
    texts: list[str]
    sources: list[list[int]]  # token ids of each text, ending with EOS
    beam_size: int
    max_new_tokens: int
    started: float  # time.perf_counter() when the request arrived
    options: DecodeOptions = field(default_factory=DecodeOptions)  # scores, hypotheses, target prefix

    @property
    def runtime(self) -> Runtime:
        """The model's runtime (ready: resolved by the registry)."""
        assert self.entry.runtime is not None
        return self.entry.runtime


def prepare(
    entry: ModelEntry,
    texts: list[str],
    beam_size: int,
    max_new_tokens: int | None,
    settings: Settings,
    where: Sequence[str] | None = None,
    started: float | None = None,
) -> Prepared:
    """Check the texts and options against the limits and tokenize them (`InvalidInput`).

    `where` names each text in error messages (default `texts.<i>`).
    """
    assert entry.runtime is not None and entry.batcher is not None
    names = list(where) if where is not None else [f"texts.{i}" for i in range(len(texts))]
    check_texts(texts, names, settings)
    sources = encode(entry.runtime, texts, names, settings)
    limit = max_new_tokens_for(max_new_tokens, entry.runtime, settings)
    return Prepared(entry, list(texts), sources, beam_size, limit,
                    time.perf_counter() if started is None else started)


async def generate(
    prepared: Prepared, settings: Settings, deadline: Deadline | None = None,
    request: Request | None = None,
) -> list[Generated]:
    """Every row of the request through the batcher, within the request's deadline (default
    `request_timeout_s`); with `request`, dropped as soon as its client goes away."""
    entry = prepared.entry
    assert entry.batcher is not None
    submitted: Awaitable[list[Generated]] = entry.batcher.submit(
        prepared.sources, prepared.beam_size, prepared.max_new_tokens,
        deadline.at if deadline is not None else None, hooks=prepared.options.hooks(len(prepared.sources)),
    )
    if request is not None:
        submitted = unless_disconnected(request, submitted, entry.name)
    return await within_deadline(submitted, entry, prepared.started, settings,
                                 budget_s=deadline.budget_s if deadline is not None else None)


def output(runtime: Runtime, source: list[int], result: Generated, **extra: Any) -> Output:
    """The transport form of one generated row."""
    return Output(
        text=runtime.tokenizer.decode(result.tokens),
        finish_reason=result.finish_reason,  # type: ignore[arg-type]
        input_tokens=len(source),
        output_tokens=len(result.tokens),
        **extra,
    )


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
    budget_s: float | None = None,
) -> T:
    """`await work`, or `DeadlineExceeded` (504) once the request is `budget_s` old
    (default `request_timeout_s`), whether it was still queued or running."""
    budget_s = settings.request_timeout_s if budget_s is None else budget_s
    remaining = budget_s - (time.perf_counter() - started)
    try:
        return await asyncio.wait_for(work, remaining)
    except (TimeoutError, DeadlineExceeded):
        metrics.REJECTED_TOTAL.labels(entry.name, "deadline").inc()
        raise DeadlineExceeded(f"no result within the deadline of {budget_s:g}s") from None


def check_texts(texts: list[str], where: Sequence[str], settings: Settings) -> None:
    """The configured count and character limits (the schema holds only the hard caps)."""
    if not texts:
        raise InvalidInput("texts: at least one text is needed")
    if len(texts) > settings.max_texts:
        raise InvalidInput(f"texts: {len(texts)} texts; at most {settings.max_texts} allowed")
    for i, text in enumerate(texts):
        if len(text) > settings.max_text_chars:
            raise InvalidInput(
                f"{where[i]}: {len(text)} characters; "
                f"at most {settings.max_text_chars} allowed"
            )


def encode(
    runtime: Runtime, texts: list[str], where: Sequence[str], settings: Settings
) -> list[list[int]]:
    """Token ids of each text with EOS appended, within the model's source length."""
    tokenizer = runtime.tokenizer
    limit = runtime.max_source_len - 1  # room for EOS
    if settings.max_input_tokens is not None:
        limit = min(limit, settings.max_input_tokens)
    sources = []
    for i, ids in enumerate(tokenizer.encode_batch(texts)):
        if not ids:
            raise InvalidInput(f"{where[i]}: the text has no tokens")
        if len(ids) > limit:
            raise InvalidInput(
                f"{where[i]}: {len(ids)} tokens; at most {limit} allowed"
            )
        sources.append([*ids, tokenizer.eos_id])
    return sources


def max_new_tokens_for(asked: int | None, runtime: Runtime, settings: Settings) -> int:
    """The request's token limit, or the server's default, within the model's target length."""
    limit = runtime.max_target_len
    if asked is None:
        return min(settings.default_max_new_tokens or limit, limit)
    if asked > limit:
        raise InvalidInput(f"max_new_tokens: at most {limit} for model {runtime.name!r}")
    return asked
