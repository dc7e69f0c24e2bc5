"""`POST /v1/attention`: encoder, decoder and cross attention of a source and a target.

The stages: schema validation, the model (by name, else the task's default), layer and head
indices checked against the model, the source (and target) tokenized within the attention
limits, the target generated greedily through the batcher when none is given, the size of the
response checked against `attention_max_cells`, then one teacher-forced pass in the model's
worker thread, which also serialises the response (and, with `alignment`, aligns the words
from the same pass). Conventions: `service.generation.attention_maps`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request, Response

from service.api.deadline import request_deadline
from service.api.pipeline import attention_runtime, within_deadline
from service.api.routes.deps import JsonInferenceDep
from service.api.routes.generate import ERROR_RESPONSES
from service.api.schemas import AttentionRequest, AttentionResponse
from service.core.errors import InvalidInput
from service.core.settings import Settings
from service.generation import attention_maps
from service.generation.attention_maps import Selection
from service.runtime.protocol import Runtime

router = APIRouter(tags=["attention"])


@router.post("/v1/attention", response_model=AttentionResponse, responses=ERROR_RESPONSES)
async def post_attention(
    body: AttentionRequest, request: Request, serving: JsonInferenceDep
) -> Response:
    """Attention weights `[layer][head][query][key]` of each kind asked for, with the tokens."""
    started = time.perf_counter()
    registry, settings = serving.registry, serving.settings
    task = body.task if body.task is not None or body.model is not None else "translate"
    entry = registry.resolve(task, body.model)
    request.state.model = entry.name  # the metrics label of this request
    assert entry.runtime is not None and entry.batcher is not None
    runtime = attention_runtime(entry.runtime)
    deadline = request_deadline(request, None, settings, started)  # X-Request-Timeout-Ms
    selection = Selection(
        kinds=tuple(body.kinds),
        layers=tuple(body.layers) if body.layers is not None else None,
        heads=tuple(body.heads) if body.heads is not None else None,
        average_heads=body.average_heads,
        decimals=body.decimals,
    )
    _check_indices(runtime, selection)
    source_ids, source_tokens = _source(runtime, body.source, settings)
    if body.target is not None:
        target_text = body.target
        target_ids, target_tokens = _given_target(runtime, target_text, settings)
    else:
        _check_cells(runtime, selection, len(source_ids), 1, settings)  # before generating
        submitted = entry.batcher.submit([source_ids], 1, _generation_limit(runtime, settings),
                                         deadline.at)
        [result] = await within_deadline(
            submitted, entry, started, settings, request=request,
            budget_s=deadline.budget_s,
        )
        target_ids = list(result.tokens)
        target_text, spans = runtime.tokenizer.decode_with_offsets(target_ids)
        target_tokens = attention_maps.labels(
            runtime.tokenizer.pieces(target_ids), spans, len(target_text), True
        )
    _check_cells(runtime, selection, len(source_ids), len(target_ids) + 1, settings)
    fields: dict[str, Any] = {
        "model": entry.name,
        "source_tokens": source_tokens,
        "target_tokens": target_tokens,
        "target_text": target_text,
        "generated": body.target is None,
        "layers": {kind: selection.layer_indices(runtime, kind) for kind in selection.kinds},
        "heads": selection.head_indices(runtime),
        "average_heads": selection.average_heads,
    }
    texts = None
    if body.alignment:
        texts = attention_maps.Texts(body.source, _spans(source_tokens), target_text,
                                     _spans(target_tokens))
    content = await within_deadline(
        entry.batcher.run(attention_maps.attention_json, runtime, source_ids, target_ids, selection,
                          fields, texts),
        entry, started, settings, budget_s=deadline.budget_s,
    )
    return Response(content=content, media_type="application/json")


def _spans(tokens: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The character spans of labelled tokens, without the closing `</s>`."""
    return [(t["start"], t["end"]) for t in tokens[:-1]]


def _check_indices(runtime: Runtime, selection: Selection) -> None:
    """Every layer asked for exists in each kind asked for, every head in the model."""
    for kind in selection.kinds:
        count = attention_maps.layer_count(runtime, kind)
        bad = [i for i in selection.layers or () if i >= count]
        if bad:
            raise InvalidInput(f"layers: {bad} out of range; the {kind} attention has "
                               f"{count} layers (0 to {count - 1})")
    bad = [i for i in selection.heads or () if i >= runtime.n_heads]
    if bad:
        raise InvalidInput(f"heads: {bad} out of range; the model has {runtime.n_heads} heads "
                           f"(0 to {runtime.n_heads - 1})")


def _check_cells(runtime: Runtime, selection: Selection, source_len: int,
                 target_len: int, settings: Settings) -> None:
    """The response's weights (for these lengths, with EOS) within `attention_max_cells`."""
    cells = selection.cells(runtime, source_len, target_len)
    if cells > settings.attention_max_cells:
        raise InvalidInput(
            f"the maps asked for hold {cells} weights; at most {settings.attention_max_cells} "
            "allowed: ask for fewer kinds, layers or heads, or average the heads"
        )


def _check_chars(where: str, text: str, settings: Settings) -> None:
    if len(text) > settings.max_text_chars:
        raise InvalidInput(f"{where}: {len(text)} characters; "
                           f"at most {settings.max_text_chars} allowed")


def _source(
    runtime: Runtime, text: str, settings: Settings
) -> tuple[list[int], list[dict[str, Any]]]:
    """The encoder's input (ids then EOS) and its tokens, within the source limits."""
    _check_chars("source", text, settings)
    ids, spans = runtime.tokenizer.encode_with_offsets(text)
    limit = min(runtime.max_source_len - 1, settings.attention_max_source_tokens)
    if settings.max_input_tokens is not None:
        limit = min(limit, settings.max_input_tokens)
    if not ids:
        raise InvalidInput("source: the text has no tokens")
    if len(ids) > limit:
        raise InvalidInput(f"source: {len(ids)} tokens; at most {limit} allowed")
    tokens = attention_maps.labels(runtime.tokenizer.pieces(ids), spans, len(text), True)
    return [*ids, runtime.eos_id], tokens


def _given_target(
    runtime: Runtime, text: str, settings: Settings
) -> tuple[list[int], list[dict[str, Any]]]:
    """The target's ids (no BOS/EOS; tokenized as a target text) and its tokens (then `</s>`),
    within the target limits."""
    _check_chars("target", text, settings)
    ids, spans = runtime.tokenizer.encode_target_with_offsets(text)
    limit = min(runtime.max_target_len, settings.attention_max_target_tokens)
    if len(ids) > limit:
        raise InvalidInput(f"target: {len(ids)} tokens; at most {limit} allowed")
    return ids, attention_maps.labels(runtime.tokenizer.pieces(ids), spans, len(text), True)


def _generation_limit(runtime: Runtime, settings: Settings) -> int:
    """`max_new_tokens` of a generated target: the server's, within the attention limit."""
    limit = min(settings.default_max_new_tokens or runtime.max_target_len,
                runtime.max_target_len)
    return min(limit, settings.attention_max_target_tokens)
