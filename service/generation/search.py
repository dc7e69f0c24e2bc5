"""The generation loop on onnxruntime: batched greedy and beam search with a key/value cache.

Torch-free (numpy). It produces exactly the tokens of the PyTorch reference,
`model.decoding.greedy_decode` / `beam_search`, and follows the same rules:
- sources are token ids ending with EOS; outputs exclude BOS and EOS;
- at most `max_new_tokens` tokens per row, EOS included; finish_reason "eos" or "length";
- finished rows leave the batch (their cache rows are dropped);
- beam search scores a hypothesis by its summed log-probability / (length incl. EOS) **
  length_penalty, accepts EOS only within the top `beam_size` candidates of a step, and closes a
  row once it holds `beam_size` finished hypotheses (fairseq's rule); beam 1 is greedy.

Streaming: `hooks` (one per source, or None) let a caller see greedy tokens as they are decoded
(`on_token`, called in this thread) and drop a row between decoder steps (`cancelled`); a
cancelled row ends with finish_reason "cancelled" and leaves the batch like a finished one.
Beam search calls no `on_token` (a beam's tokens may still change): the caller streams the
final hypothesis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from model.stopping import EOS, StoppingCriteria
from service.generation.hooks import RowHooks
from service.runtime import EncoderState, KVCache
from service.runtime.protocol import Runtime

Hooks = Sequence[RowHooks | None]


@dataclass(frozen=True)
class GenerationResult:
    """One generated sequence."""

    tokens: list[int]
    finish_reason: str  # "eos" | "length" | "cancelled"
    score: float | None  # summed log-probability (greedy; None when not asked) or the length-normalised beam score


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis, in float32."""
    logits = logits.astype(np.float32, copy=False)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def greedy_choice(logits: np.ndarray, scores: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """The most likely token of each row of (B, V) `logits` and its log-probability: the same as
    `log_softmax` then argmax, without building the (B, V) log-probabilities. Without `scores`,
    only the argmax (None for the log-probabilities): the exponentials over the vocabulary are
    most of the cost."""
    best = logits.argmax(axis=-1)  # (B,)
    if not scores:
        return best, None
    shifted = logits - logits[np.arange(len(best)), best][:, None]  # (B, V), <= 0
    np.exp(shifted, out=shifted)
    return best, -np.log(shifted.sum(axis=-1, dtype=np.float32))  # (B,), (B,)


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (score, index) of each row of (R, N) `scores`, best first."""
    k = min(k, scores.shape[-1])
    index = np.argpartition(-scores, k - 1, axis=-1)[:, :k]  # (R, k), unordered
    order = np.argsort(-np.take_along_axis(scores, index, axis=-1), axis=-1, kind="stable")
    index = np.take_along_axis(index, order, axis=-1)
    return np.take_along_axis(scores, index, axis=-1), index


def generate(
    runtime: Runtime,
    sources: list[list[int]],
    beam_size: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
    hooks: Hooks | None = None,
    greedy_scores: bool = True,
) -> list[GenerationResult]:
    """Generate for each source (ids ending with EOS); one result per source, in order.

    Without `greedy_scores`, greedy results carry no score (None): picking each token is then an
    argmax, without the log-softmax over the vocabulary that its log-probability needs.
    """
    if not sources:
        return []
    if any(not s for s in sources):
        raise ValueError("every source needs at least its EOS")
    if beam_size < 1 or max_new_tokens < 1:
        raise ValueError(f"beam_size and max_new_tokens must be >= 1, got {beam_size}, {max_new_tokens}")
    if hooks is not None and len(hooks) != len(sources):
        raise ValueError(f"{len(hooks)} hooks for {len(sources)} sources")
    state = runtime.encode(runtime.pad(sources))
    if beam_size == 1:
        return greedy(runtime, state, max_new_tokens, hooks, scores=greedy_scores)
    return beam_search(runtime, state, beam_size, max_new_tokens, length_penalty, hooks)


def _cancelled(hooks: Hooks | None, row: int) -> bool:
    hook = hooks[row] if hooks is not None else None
    return hook is not None and hook.cancelled


def _emit(hooks: Hooks | None, row: int, token: int) -> None:
    hook = hooks[row] if hooks is not None else None
    if hook is not None and hook.on_token is not None:
        hook.on_token(token)


def greedy(
    runtime: Runtime, state: EncoderState, max_new_tokens: int, hooks: Hooks | None = None,
    scores: bool = True,
) -> list[GenerationResult]:
    """The most likely token at every step; a row stops at EOS, at the token limit or when its
    hook is cancelled. Each result's score is its summed log-probability, or None without
    `scores`."""
    batch = state.source_mask.shape[0]
    results: list[GenerationResult | None] = [None] * batch
    tokens: list[list[int]] = [[] for _ in range(batch)]
    summed = [0.0] * batch

    def score(row: int) -> float | None:
        return summed[row] if scores else None

    active = np.arange(batch)  # original row of each row still decoding
    last = np.full((batch, 1), runtime.decoder_start_id, dtype=np.int64)
    cache: KVCache | None = None
    stop = StoppingCriteria(runtime.eos_id, max_new_tokens)
    for _ in range(max_new_tokens):
        out = runtime.decode(last, state, cache)
        best, chosen = greedy_choice(out.logits[:, -1], scores)  # (B_active,) each
        keep = []
        for i, row in enumerate(active.tolist()):
            token = int(best[i])
            if chosen is not None:
                summed[row] += float(chosen[i])
            reason = stop(token, len(tokens[row]), _cancelled(hooks, row))
            if reason != EOS:
                tokens[row].append(token)
                _emit(hooks, row, token)
            if reason is not None:
                results[row] = GenerationResult(tokens[row], reason, score(row))
            else:
                keep.append(i)
        if not keep:
            break
        rows = np.asarray(keep)
        last, cache = best[rows][:, None], out.cache
        if len(keep) < len(active):  # finished rows leave the batch
            active, state, cache = active[rows], state.select(rows), cache.select(rows)
    return [r if r is not None else GenerationResult([], "length", 0.0 if scores else None) for r in results]


def beam_search(
    runtime: Runtime, state: EncoderState, beam_size: int, max_new_tokens: int, length_penalty: float,
    hooks: Hooks | None = None,
) -> list[GenerationResult]:
    """Beam search; the beams of open row r sit at r*k..r*k+k-1 of the decoder batch.

    A row whose hook is cancelled closes with its best open beam, finish_reason "cancelled"."""
    batch, k = state.source_mask.shape[0], beam_size
    state = state.select(np.repeat(np.arange(batch), k))  # (B*K, ...)
    cache: KVCache | None = None
    beam_tokens: list[list[int]] = [[] for _ in range(batch * k)]
    beam_scores = np.zeros((batch, k), dtype=np.float32)
    beam_scores[:, 1:] = -np.inf  # all beams start identical: expand only the first
    last = np.full((batch * k, 1), runtime.decoder_start_id, dtype=np.int64)
    finished: list[list[GenerationResult]] = [[] for _ in range(batch)]
    cancelled: dict[int, GenerationResult] = {}
    open_rows = list(range(batch))
    for step in range(max_new_tokens):
        out = runtime.decode(last, state, cache)
        log_probs = log_softmax(out.logits[:, -1])  # (R*K, V)
        vocab = log_probs.shape[-1]
        candidates = (beam_scores[open_rows].reshape(-1, 1) + log_probs).reshape(len(open_rows), k * vocab)
        top_scores, top_index = top_k(candidates, 2 * k)  # (R, 2K)
        length = step + 1
        next_tokens: list[int] = []
        next_scores: list[float] = []
        next_beams: list[int] = []
        still_open: list[int] = []
        for r, row in enumerate(open_rows):
            alive: list[tuple[int, int, float]] = []  # (beam position in batch, token, score)
            for rank in range(top_index.shape[1]):
                beam = r * k + int(top_index[r, rank]) // vocab
                token = int(top_index[r, rank]) % vocab
                score = float(top_scores[r, rank])
                if token == runtime.eos_id:
                    if rank < k and len(finished[row]) < k:
                        normalised = score / length**length_penalty
                        finished[row].append(GenerationResult(list(beam_tokens[beam]), "eos", normalised))
                elif len(alive) < k:
                    alive.append((beam, token, score))
            if len(finished[row]) >= k:
                continue
            if _cancelled(hooks, row) and step < max_new_tokens - 1:
                beam, token, score = alive[0]
                cancelled[row] = GenerationResult(beam_tokens[beam] + [token], "cancelled", score)
                continue
            if step == max_new_tokens - 1:
                for beam, token, score in alive[: k - len(finished[row])]:
                    normalised = score / length**length_penalty
                    finished[row].append(GenerationResult(beam_tokens[beam] + [token], "length", normalised))
                continue
            still_open.append(row)
            for beam, token, score in alive:
                next_beams.append(beam)
                next_tokens.append(token)
                next_scores.append(score)
        if not still_open:
            break
        cache = out.cache.select(np.asarray(next_beams))
        if len(still_open) < len(open_rows):  # closed rows leave; beams of one row share the source
            kept = [open_rows.index(row) for row in still_open]
            state = state.select(np.asarray([r * k + j for r in kept for j in range(k)]))
        beam_tokens = [beam_tokens[b] + [t] for b, t in zip(next_beams, next_tokens, strict=True)]
        beam_scores[still_open] = np.asarray(next_scores, dtype=np.float32).reshape(len(still_open), k)
        last = np.asarray(next_tokens, dtype=np.int64)[:, None]
        open_rows = still_open
    return [
        cancelled[row] if row in cancelled else max(hyps, key=lambda g: -np.inf if g.score is None else g.score)
        for row, hyps in enumerate(finished)
    ]


@dataclass(frozen=True)
class AttentionMaps:
    """Attention of one source/target pair, per layer, each (heads, queries, keys)."""

    source_ids: list[int]  # the encoder's tokens (ending with EOS)
    decoder_ids: list[int]  # the decoder's input tokens: the start token (BOS unless the model names another) + target
    encoder: list[np.ndarray]  # (h, S, S)
    decoder: list[np.ndarray]  # (h, T, T): query i is the step that predicts target token i (then EOS)
    cross: list[np.ndarray]  # (h, T, S)


def teacher_forced_attention(runtime: Runtime, source_ids: list[int], target_ids: list[int]) -> AttentionMaps:
    """Encoder, decoder and cross attention of `target_ids` (no BOS/EOS) given `source_ids`
    (ending with EOS): one encoder call and one decoder call with past length 0."""
    state = runtime.encode(np.asarray([source_ids], dtype=np.int64), need_attention=True)
    decoder_ids = [runtime.decoder_start_id, *target_ids]
    step = runtime.decode(np.asarray([decoder_ids], dtype=np.int64), state, need_attention=True)
    assert state.attentions is not None and step.self_attentions is not None and step.cross_attentions is not None
    return AttentionMaps(
        list(source_ids), decoder_ids,
        [a[0] for a in state.attentions], [a[0] for a in step.self_attentions], [a[0] for a in step.cross_attentions],
    )
