"""`POST /v1/translate` and `POST /v1/summarize`: texts in, generated texts out.

The stages of one request: schema validation (FastAPI), the configured limits, tokenization
with the model's limits, admission into the model's batcher (429 when full), waiting for the
batch under the request's deadline (504; `service.deadline`) while watching for the client to
go away (`service.disconnect`), detokenization. With `return_attention`, one more
teacher-forced pass over the outputs, in the model's worker thread, gives their cross-attention
(`service.attention.alignments`; exact for greedy and beam search alike).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request

from service import attention, metrics
from service.deadline import request_deadline
from service.disconnect import unless_disconnected
from service.errors import DeadlineExceeded, InvalidInput
from service.registry import ModelEntry, ModelRegistry, Runtime
from service.routes.deps import RegistryDep, SettingsDep
from service.schemas import ErrorBody, GenerateRequest, GenerateResponse, Output, Usage
from service.settings import Settings

T = TypeVar("T")

router = APIRouter(tags=["generate"])

ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 413, 415, 422, 429, 500, 503, 504)
}


@router.post("/v1/translate", responses=ERROR_RESPONSES, response_model_exclude_none=True)
async def translate(
    body: GenerateRequest, request: Request, registry: RegistryDep, settings: SettingsDep
) -> GenerateResponse:
    """Translate one text or a list of texts with a translation model."""
    return await _generate("translate", body, request, registry, settings)


@router.post("/v1/summarize", responses=ERROR_RESPONSES, response_model_exclude_none=True)
async def summarize(
    body: GenerateRequest, request: Request, registry: RegistryDep, settings: SettingsDep
) -> GenerateResponse:
    """Summarize one text or a list of texts with a summarization model."""
    return await _generate("summarize", body, request, registry, settings)


async def _generate(
    task: str,
    body: GenerateRequest,
    request: Request,
    registry: ModelRegistry,
    settings: Settings,
) -> GenerateResponse:
    started = time.perf_counter()
    entry = registry.resolve(task, body.model)
    request.state.model = entry.name  # the metrics label of this request
    assert entry.runtime is not None and entry.batcher is not None
    runtime = entry.runtime
    texts = body.inputs
    where = ["text"] if body.texts is None else [f"texts.{i}" for i in range(len(texts))]
    _check_texts(texts, where, settings)
    # 422 now, rather than after generating, for a model without attention outputs.
    maps_runtime = attention_runtime(runtime) if body.return_attention else None
    sources = _encode(runtime, texts, where, settings)
    max_new_tokens = _max_new_tokens(body.max_new_tokens, runtime, settings)
    deadline = request_deadline(request, body.timeout_ms, settings, started)
    submitted = entry.batcher.submit(sources, body.beam_size, max_new_tokens, deadline.at)
    results = await within_deadline(
        unless_disconnected(request, submitted, entry.name), entry, started, settings,
        budget_s=deadline.budget_s,
    )
    extras: list[dict[str, Any]] = [{} for _ in results]
    if maps_runtime is not None:
        generated = [(list(r.tokens), r.finish_reason == "eos") for r in results]
        maps = await within_deadline(
            entry.batcher.run(attention.alignments, maps_runtime, sources, generated),
            entry, started, settings, budget_s=deadline.budget_s,
        )
        for i, extra in enumerate(extras):
            source_tokens, target_tokens = _alignment_labels(runtime, texts[i], *generated[i])
            extra.update(attention=maps[i], source_tokens=source_tokens,
                         target_tokens=target_tokens)
    outputs = [
        Output(
            text=runtime.tokenizer.decode(result.tokens),
            finish_reason=result.finish_reason,  # type: ignore[arg-type]
            input_tokens=len(source),
            output_tokens=len(result.tokens),
            **extra,
        )
        for source, result, extra in zip(sources, results, extras, strict=True)
    ]
    usage = Usage(
        input_tokens=sum(o.input_tokens for o in outputs),
        output_tokens=sum(o.output_tokens for o in outputs),
    )
    return GenerateResponse(model=entry.name, outputs=outputs, usage=usage)


def attention_runtime(runtime: Any) -> attention.AttentionRuntime:
    """The runtime, if it gives attention weights; else 422."""
    if not isinstance(runtime, attention.AttentionRuntime):
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


def _alignment_labels(
    runtime: Runtime, text: str, tokens: list[int], ended_with_eos: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The source's tokens (and `</s>`), and the output's (and `</s>` if generated)."""
    tokenizer = runtime.tokenizer
    source_ids, source_spans = tokenizer.encode_with_offsets(text)
    source = attention.labels(tokenizer.pieces(source_ids), source_spans, len(text), True)
    output, target_spans = tokenizer.decode_with_offsets(tokens)
    target = attention.labels(tokenizer.pieces(tokens), target_spans, len(output), ended_with_eos)
    return source, target


def _check_texts(texts: list[str], where: list[str], settings: Settings) -> None:
    """The configured count and character limits (the schema holds only the hard caps)."""
    if len(texts) > settings.max_texts:
        raise InvalidInput(f"texts: {len(texts)} texts; at most {settings.max_texts} allowed")
    for i, text in enumerate(texts):
        if len(text) > settings.max_text_chars:
            raise InvalidInput(
                f"{where[i]}: {len(text)} characters; "
                f"at most {settings.max_text_chars} allowed"
            )


def _encode(
    runtime: Runtime, texts: list[str], where: list[str], settings: Settings
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


def _max_new_tokens(asked: int | None, runtime: Runtime, settings: Settings) -> int:
    """The request's token limit, or the server's default, within the model's target length."""
    limit = runtime.max_target_len
    if asked is None:
        return min(settings.default_max_new_tokens or limit, limit)
    if asked > limit:
        raise InvalidInput(f"max_new_tokens: at most {limit} for model {runtime.name!r}")
    return asked

