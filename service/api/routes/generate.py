"""`POST /v1/translate` and `POST /v1/summarize`: texts in, generated texts out.

The stages of one request (`service.api.pipeline`): schema validation (FastAPI), the configured
limits, tokenization with the model's limits, admission into the model's batcher (429 when
full), waiting for the batch under the request's deadline (504; `service.api.deadline`) while
watching for the client to go away (`service.api.disconnect`), detokenization. With
`return_attention`, one more teacher-forced pass over the outputs, in the model's worker
thread, gives their cross-attention (`service.generation.attention_maps.alignments`; exact for greedy and beam
search alike); with `return_alignment`, one such pass gives their word alignments
(`service.generation.attention_maps.word_alignments`). With `stream`, one text is answered with
Server-Sent Events (`service.api.streaming`), the alignment in its final event. Scores,
n-best hypotheses and a target prefix: `service.api.decode_options`. Translation splits long
texts into sentences, unless a request asks for attention, alignments, scores, hypotheses or a
target prefix (each relates one source to one output); summarization refuses a text longer than
the model's window unless `truncate`. A successful JSON answer carries the request's stage times in its
`Server-Timing` header (`service.observability.timing`; KServe v2's `infer` answers it too).
With `temperature` > 0 (and `top_k`, `top_p`, `seed`) each output token is sampled rather than
the most likely (`service.generation.sampling`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter, Request, Response

from service.api import pipeline, streaming
from service.api.deadline import request_deadline
from service.api.decode_options import decode_options, sampling, whole_texts
from service.api.pipeline import attention_runtime, within_deadline
from service.api.routes.deps import JsonInferenceDep
from service.api.schemas import ErrorBody, GenerateRequest, GenerateResponse
from service.core.registry import ModelRegistry
from service.core.settings import Settings
from service.generation import attention_maps
from service.observability.timing import SERVER_TIMING, RequestTiming
from service.runtime.protocol import Runtime

router = APIRouter(tags=["generate"])

ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 408, 413, 415, 422, 429, 500, 503, 504)
}
GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    # OpenAPI 3.1: the `schema` of an event stream describes each event (its SSE fields)
    200: {"content": {streaming.MEDIA_TYPE: {
        "schema": {"type": "object", "required": ["data"], "properties": {
            "data": {"type": "string", "description": "JSON: a token event or the final one"},
            "event": {"type": "string"}}},
        "description": "with `stream`: one `data: {json}` event per token, then a final one",
    }}},
}


@router.post("/v1/translate", response_model=GenerateResponse, responses=GENERATE_RESPONSES,
             response_model_exclude_none=True)
async def translate(
    body: GenerateRequest, request: Request, response: Response, serving: JsonInferenceDep
) -> Any:
    """Translate one text or a list of texts with a translation model."""
    return await generate_texts("translate", body, request, response, serving.registry, serving.settings)


@router.post("/v1/summarize", response_model=GenerateResponse, responses=GENERATE_RESPONSES,
             response_model_exclude_none=True)
async def summarize(
    body: GenerateRequest, request: Request, response: Response, serving: JsonInferenceDep
) -> Any:
    """Summarize one text or a list of texts with a summarization model."""
    return await generate_texts("summarize", body, request, response, serving.registry, serving.settings)


async def generate_texts(
    task: str | None,
    body: GenerateRequest,
    request: Request,
    response: Response,
    registry: ModelRegistry,
    settings: Settings,
    events: streaming.Events | None = None,
) -> GenerateResponse | Response:
    """One request of `task` (any task when None; `body` validated): its answer, or its event
    stream with `stream` (written by `events`, default the server's own); the stage times go on
    `response`'s `Server-Timing` header. Also LibreTranslate's `/translate` and OpenAI's
    completions (`service.api.routes.libretranslate`, `service.api.routes.openai`)."""
    started = time.perf_counter()
    timing = RequestTiming(started)
    request.state.timing = timing  # for the request's trace (service.observability.tracing)
    entry = registry.resolve(task, body.model)
    request.state.model = entry.name  # the metrics label of this request
    assert entry.runtime is not None and entry.batcher is not None
    runtime = entry.runtime
    texts = body.inputs
    where = ["text"] if body.texts is None else [f"texts.{i}" for i in range(len(texts))]
    # 422 now, rather than after generating, for a model without attention outputs.
    needs_maps = body.return_attention or body.return_alignment
    maps_runtime = attention_runtime(runtime) if needs_maps else None
    sampled = sampling(body.temperature, body.top_k, body.top_p, body.seed, body.beam_size)
    whole = whole_texts(return_scores=body.return_scores, num_hypotheses=body.num_hypotheses,
                        target_prefix=body.target_prefix, maps=needs_maps)
    prepared = pipeline.prepare(entry, texts, body.beam_size, body.max_new_tokens, settings,
                                where, started, body.truncate, whole_texts=whole)
    options = decode_options(runtime, len(texts), body.beam_size, prepared.max_new_tokens,
                             return_scores=body.return_scores, num_hypotheses=body.num_hypotheses,
                             target_prefix=body.target_prefix, sampled=sampled)
    prepared = dataclasses.replace(prepared, options=options)
    deadline = request_deadline(request, body.timeout_ms, settings, started)
    if body.stream:
        return streaming.stream(prepared, request.receive, settings, deadline,
                                alignment=body.return_alignment, timing=timing, events=events)
    sources = prepared.sources
    results = await pipeline.generate(prepared, settings, deadline, request, timing)
    extras: list[dict[str, Any]] = [{} for _ in texts]  # one per text
    if maps_runtime is not None and body.return_alignment:
        found = await within_deadline(
            entry.batcher.run(attention_maps.word_alignments, maps_runtime, texts, sources,
                              [list(r.tokens) for r in results]),
            entry, started, settings, budget_s=deadline.budget_s,
        )
        for extra, words in zip(extras, found, strict=True):
            extra["alignment"] = words
    if maps_runtime is not None and body.return_attention:
        generated = [(list(r.tokens), r.finish_reason == "eos") for r in results]
        maps = await within_deadline(
            entry.batcher.run(attention_maps.alignments, maps_runtime, sources, generated),
            entry, started, settings, budget_s=deadline.budget_s,
        )
        for i, extra in enumerate(extras):
            source_tokens, target_tokens = _alignment_labels(runtime, texts[i], *generated[i])
            extra.update(attention=maps[i], source_tokens=source_tokens,
                         target_tokens=target_tokens)
    if options.per_text:  # one row per text (`whole_texts`)
        for extra, result in zip(extras, results, strict=True):
            extra.update(options.extras(runtime, result))
    outputs = pipeline.outputs(prepared, results, extras)
    answer = GenerateResponse(model=entry.name, outputs=outputs, usage=pipeline.usage(outputs))
    response.headers[SERVER_TIMING] = timing.header(time.perf_counter())
    return answer


def _alignment_labels(
    runtime: Runtime, text: str, tokens: list[int], ended_with_eos: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The source's tokens (and `</s>`), and the output's (and `</s>` if generated)."""
    tokenizer = runtime.tokenizer
    source_ids, source_spans = tokenizer.encode_with_offsets(text)
    source = attention_maps.labels(tokenizer.pieces(source_ids), source_spans, len(text), True)
    output, target_spans = tokenizer.decode_with_offsets(tokens)
    target = attention_maps.labels(tokenizer.pieces(tokens), target_spans, len(output), ended_with_eos)
    return source, target
