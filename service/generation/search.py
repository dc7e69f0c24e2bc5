"""The generation loop on onnxruntime: batched greedy and beam search with a key/value cache.

Torch-free (numpy). It produces exactly the tokens of the PyTorch reference,
`model.decoding.greedy_decode` / `beam_search`, and follows the same rules:
- sources are token ids ending with EOS; outputs exclude BOS and EOS;
- at most `max_new_tokens` tokens per row, EOS included; finish_reason "eos" or "length";
- finished rows leave the batch (their cache rows are dropped);
- beam search scores a hypothesis by its summed log-probability / (length incl. EOS) **
  length_penalty, accepts EOS only within the top `beam_size` candidates of a step, and closes a
  row once it holds `beam_size` finished hypotheses (fairseq's rule); beam 1 is greedy.

A row's hooks may also force a prefix (`RowHooks.prefix`: the decoder is fed those tokens as
the step's choice, greedy and beam alike; they are part of the output and its token limit, and
their log-probabilities count in its scores), draw a greedy row's tokens instead of taking the
most likely (`RowHooks.sampler`, `service.generation.sampling`; its scores are the model's
log-probabilities of the drawn tokens), ask for its tokens' log-probabilities
(`RowHooks.scores`: `token_scores`, one per output token, and `log_prob`, their sum plus the
log-probability of EOS when the row ended with it) and for beam search's n best finished
hypotheses (`RowHooks.hypotheses`).

Streaming: `hooks` (one per source, or None) let a caller see greedy tokens as they are decoded
(`on_token`, called in this thread) and drop a row between decoder steps (`cancelled`); a
cancelled row ends with finish_reason "cancelled" and leaves the batch like a finished one.
Beam search calls no `on_token` (a beam's tokens may still change): the caller streams the
final hypothesis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from model.stopping import EOS, StoppingCriteria
from service.generation.hooks import RowHooks
from service.generation.ranking import top_k
from service.generation.sampling import Sampler, draw
from service.runtime import EncoderState, KVCache
from service.runtime.protocol import Runtime

Hooks = Sequence[RowHooks | None]


@dataclass(frozen=True)
class GenerationResult:
    """One generated sequence."""

    tokens: list[int]
    finish_reason: str  # "eos" | "length" | "cancelled"
    score: float | None  # summed log-probability (greedy; None when not asked) or the length-normalised beam score
    # log-probability of each of `tokens`, when the row asked (`RowHooks.scores`)
    token_scores: tuple[float, ...] | None = None
    # the summed log-probability of `tokens` and of EOS when the row ended with it (beam search: always;
    # greedy: when the row asked)
    log_prob: float | None = None
    # beam search's finished hypotheses, best first, when the row asked for more than one
    hypotheses: tuple[GenerationResult, ...] | None = None


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


def token_log_probs(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """`log_softmax(logits)[i, tokens[i]]` for each row of (R, V) `logits`, in float32, without
    building the (R, V) log-probabilities; for the argmax token it equals `greedy_choice`'s."""
    logits = logits.astype(np.float32, copy=False)
    rows = np.arange(len(tokens))
    top = logits.max(axis=-1)
    shifted = logits - top[:, None]  # (R, V), <= 0
    picked = shifted[rows, tokens]
    np.exp(shifted, out=shifted)
    return picked - np.log(shifted.sum(axis=-1, dtype=np.float32))


def pick(logits: np.ndarray, scores: bool, forced: Sequence[tuple[int, int]],
         asking: Sequence[int], sampled: Sequence[tuple[int, Sampler]] = ()) -> tuple[np.ndarray, np.ndarray | None]:
    """Each row's token of one step and its log-probability: the argmax of (B, V) `logits`, for
    each `(row, token)` of `forced` that token, and for each `(row, sampler)` of `sampled` a
    draw of its sampler (`service.generation.sampling`). Log-probabilities (the model's, at
    temperature 1 over the whole vocabulary) for every row with `scores`; else only for the
    rows in `asking` (NaN for the others), None when no row needs one: rows that ask nothing
    cost nothing beyond the argmax."""
    best, chosen = greedy_choice(logits, scores)
    if not forced and not sampled and (chosen is not None or not asking):
        return best, chosen
    if sampled:
        rows = np.asarray([row for row, _ in sampled], dtype=np.int64)
        best[rows] = draw(logits[rows], [sampler for _, sampler in sampled])
    for row, token in forced:
        best[row] = token
    wanted = set(asking)
    changed = {row for row, _ in forced} | {row for row, _ in sampled}
    rescore = sorted({row for row in changed if chosen is not None or row in wanted}
                     | (wanted if chosen is None else set()))
    if rescore:
        if chosen is None:
            chosen = np.full(len(best), np.nan, dtype=np.float32)
        index = np.asarray(rescore, dtype=np.int64)
        chosen[index] = token_log_probs(logits[index], best[index])
    return best, chosen


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


def _prefix(hooks: Hooks | None, row: int) -> tuple[int, ...]:
    hook = hooks[row] if hooks is not None else None
    return hook.prefix if hook is not None else ()


def _sampler(hooks: Hooks | None, row: int) -> Sampler | None:
    hook = hooks[row] if hooks is not None else None
    return hook.sampler if hook is not None else None


def _asks(hooks: Hooks | None, row: int) -> bool:
    hook = hooks[row] if hooks is not None else None
    return hook is not None and hook.scores


def greedy(
    runtime: Runtime, state: EncoderState, max_new_tokens: int, hooks: Hooks | None = None,
    scores: bool = True,
) -> list[GenerationResult]:
    """The most likely token at every step (a row's forced prefix first; a row with a sampler
    draws its tokens instead, `service.generation.sampling`); a row stops at EOS,
    at the token limit or when its hook is cancelled. Each result's score is its summed
    log-probability, or None without `scores`; a row whose hook asks for scores gets its
    `token_scores` and `log_prob` either way."""
    batch = state.source_mask.shape[0]
    results: list[GenerationResult | None] = [None] * batch
    tokens: list[list[int]] = [[] for _ in range(batch)]
    summed = [0.0] * batch
    prefixes = [_prefix(hooks, row) for row in range(batch)]
    samplers = [_sampler(hooks, row) for row in range(batch)]
    token_scores: list[list[float] | None] = [[] if _asks(hooks, row) else None for row in range(batch)]

    def result(row: int, reason: str) -> GenerationResult:
        asked = token_scores[row]
        if asked is None:
            return GenerationResult(tokens[row], reason, summed[row] if scores else None)
        return GenerationResult(tokens[row], reason, summed[row] if scores else None,
                                token_scores=tuple(asked), log_prob=summed[row])

    active = np.arange(batch)  # original row of each row still decoding
    last = np.full((batch, 1), runtime.decoder_start_id, dtype=np.int64)
    cache: KVCache | None = None
    stop = StoppingCriteria(runtime.eos_id, max_new_tokens)
    for _ in range(max_new_tokens):
        out = runtime.decode(last, state, cache)
        rows_now = active.tolist()
        forced = [(i, prefixes[row][len(tokens[row])]) for i, row in enumerate(rows_now)
                  if len(tokens[row]) < len(prefixes[row])]
        asking = [i for i, row in enumerate(rows_now) if token_scores[row] is not None]
        sampled = [(i, sampler) for i, row in enumerate(rows_now)
                   if (sampler := samplers[row]) is not None and len(tokens[row]) >= len(prefixes[row])]
        best, chosen = pick(out.logits[:, -1], scores, forced, asking, sampled)  # (B_active,) each
        keep = []
        for i, row in enumerate(rows_now):
            token = int(best[i])
            scored = chosen is not None and (scores or token_scores[row] is not None)
            if scored:
                summed[row] += float(chosen[i])  # type: ignore[index]
            reason = stop(token, len(tokens[row]), _cancelled(hooks, row))
            if reason != EOS:
                tokens[row].append(token)
                if (asked := token_scores[row]) is not None:
                    asked.append(float(chosen[i]))  # type: ignore[index]
                _emit(hooks, row, token)
            if reason is not None:
                results[row] = result(row, reason)
            else:
                keep.append(i)
        if not keep:
            break
        rows = np.asarray(keep)
        last, cache = best[rows][:, None], out.cache
        if len(keep) < len(active):  # finished rows leave the batch
            active, state, cache = active[rows], state.select(rows), cache.select(rows)
    return [r if r is not None else result(row, "length") for row, r in enumerate(results)]


class BeamRow:
    """One source's beam search: its `k` beams (tokens, summed log-probabilities), its finished
    hypotheses, and the rules that pick the next beams from a step's log-probabilities (the
    module's: fairseq's EOS rule, the forced prefix, cancellation, the token limit).

    Its caller steps the decoder over the row's k beams and gives `advance` their (k, V)
    log-probabilities and the 2k best candidates of `scores[:, None] + log_probs`; `advance`
    answers each next beam's parent beam and token, or None once the row is closed (`result`).
    A request-level batch (`beam_search`) and the running batch (`SlotBatch`) step it alike.
    `track` keeps each beam's token log-probabilities (`token_scores` of the results)."""

    def __init__(self, k: int, eos: int, max_new_tokens: int, length_penalty: float = 1.0,
                 hooks: RowHooks | None = None, track: bool = False) -> None:
        self.k = k
        self.eos = eos
        self.max_new_tokens = max_new_tokens
        self.length_penalty = length_penalty
        self.hooks = hooks
        self.track = track
        self.prefix = hooks.prefix if hooks is not None else ()
        self.steps = 0  # decoder steps taken: every beam holds this many tokens
        self.tokens: list[list[int]] = [[] for _ in range(k)]
        self.token_scores: list[list[float]] = [[] for _ in range(k)]
        self.scores = np.zeros(k, dtype=np.float32)  # (k,) summed log-probability of each beam
        self.scores[1:] = -np.inf  # all beams start identical: expand only the first
        self.finished: list[GenerationResult] = []
        self.cancelled: GenerationResult | None = None

    def _hypothesis(self, tokens: list[int], reason: str, score: float, scored: list[float],
                    length: int | None) -> GenerationResult:
        """A finished (or cancelled) beam; its score normalised by `length` unless None."""
        return GenerationResult(tokens, reason, score if length is None else score / length**self.length_penalty,
                                token_scores=tuple(scored) if self.track else None, log_prob=score)

    def advance(self, log_probs: np.ndarray, top_scores: np.ndarray,
                top_index: np.ndarray) -> tuple[list[int], list[int]] | None:
        """One step from the beams' (k, V) `log_probs` and the row's 2k best candidates
        (`top_k` of the (k*V,) `scores[:, None] + log_probs`: scores and flat indices): the next
        beams' (parents, tokens), each parent a beam 0..k-1 of this step, or None when the row
        closed (k hypotheses finished, its hook cancelled, or its token limit reached)."""
        k, step, vocab = self.k, self.steps, log_probs.shape[-1]
        length = step + 1
        self.steps += 1
        alive: list[tuple[int, int, float]] = []  # (parent beam, token, score)
        if step < len(self.prefix):  # forced: one live beam, the others dead copies of it
            token = self.prefix[step]
            score = float(self.scores[0]) + float(log_probs[0, token])
            alive = [(0, token, score)] + [(0, token, -np.inf)] * (k - 1)
        for rank in range(len(top_index) if not alive else 0):
            beam, token = divmod(int(top_index[rank]), vocab)
            score = float(top_scores[rank])
            if token == self.eos:
                if rank < k and len(self.finished) < k:
                    self.finished.append(self._hypothesis(list(self.tokens[beam]), "eos", score,
                                                          self.token_scores[beam], length))
            elif len(alive) < k:
                alive.append((beam, token, score))
        if len(self.finished) >= k:
            return None
        if self.hooks is not None and self.hooks.cancelled and step < self.max_new_tokens - 1:
            beam, token, score = alive[0]
            scored = self.token_scores[beam] + [float(log_probs[beam, token])] if self.track else []
            self.cancelled = self._hypothesis(self.tokens[beam] + [token], "cancelled", score, scored, None)
            return None
        if step == self.max_new_tokens - 1:
            for beam, token, score in alive[: k - len(self.finished)]:
                if score == -np.inf:  # a dead copy of a forced beam
                    continue
                scored = self.token_scores[beam] + [float(log_probs[beam, token])] if self.track else []
                self.finished.append(self._hypothesis(self.tokens[beam] + [token], "length", score, scored, length))
            return None
        if self.track:
            self.token_scores = [self.token_scores[b] + [float(log_probs[b, t])] for b, t, _ in alive]
        self.tokens = [self.tokens[b] + [t] for b, t, _ in alive]
        self.scores = np.asarray([score for _, _, score in alive], dtype=np.float32)
        return [b for b, _, _ in alive], [t for _, t, _ in alive]

    def result(self) -> GenerationResult:
        """The closed row's result: its cancelled beam, or its best finished hypothesis (the
        first of the highest score); with the hook's `hypotheses` above 1, carrying that many
        of the best, best first (ties in finishing order)."""
        if self.cancelled is not None:
            return self.cancelled
        best = max(self.finished, key=lambda g: -np.inf if g.score is None else g.score)
        if self.hooks is None or self.hooks.hypotheses <= 1:
            return best
        ranked = sorted(self.finished, key=lambda g: np.inf if g.score is None else -g.score)
        return dataclasses.replace(best, hypotheses=tuple(ranked[: self.hooks.hypotheses]))


def beam_candidates(scores: np.ndarray, log_probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The 2k best candidates of each of R rows: (R, k) beam `scores` plus their (R*k, V)
    `log_probs`, flattened per row to (R, k*V); returns their scores and flat indices, (R, 2k)
    each, best first (`BeamRow.advance`'s input)."""
    candidates = (scores.reshape(-1, 1) + log_probs).reshape(len(scores), -1)
    return top_k(candidates, 2 * k)


def beam_search(
    runtime: Runtime, state: EncoderState, beam_size: int, max_new_tokens: int, length_penalty: float,
    hooks: Hooks | None = None,
) -> list[GenerationResult]:
    """Beam search, one `BeamRow` per source; the beams of open row r sit at r*k..r*k+k-1 of
    the decoder batch.

    While a row's forced prefix lasts, its first beam takes the prefix's next token and the
    others stay dead (score -inf), so every beam starts with the prefix. A row whose hook is
    cancelled closes with its best open beam, finish_reason "cancelled". Each result carries
    its summed log-probability (`log_prob`); the tokens' own (`token_scores`) are kept when a
    row of the batch asks for them, and a row asking for n hypotheses gets its n best finished
    ones (by the length-normalised score), best first."""
    batch, k = state.source_mask.shape[0], beam_size
    track = any(_asks(hooks, row) for row in range(batch))  # each beam's token log-probabilities
    rows = [BeamRow(k, runtime.eos_id, max_new_tokens, length_penalty, hooks[row] if hooks is not None else None,
                    track) for row in range(batch)]
    state = state.select(np.repeat(np.arange(batch), k))  # (B*K, ...)
    cache: KVCache | None = None
    last = np.full((batch * k, 1), runtime.decoder_start_id, dtype=np.int64)
    open_rows = list(range(batch))
    for _ in range(max_new_tokens):
        out = runtime.decode(last, state, cache)
        log_probs = log_softmax(out.logits[:, -1])  # (R*K, V)
        top_scores, top_index = beam_candidates(np.stack([rows[row].scores for row in open_rows]), log_probs, k)
        next_beams: list[int] = []
        next_tokens: list[int] = []
        still_open: list[int] = []
        for r, row in enumerate(open_rows):
            chosen = rows[row].advance(log_probs[r * k:(r + 1) * k], top_scores[r], top_index[r])
            if chosen is None:
                continue
            parents, tokens = chosen
            still_open.append(row)
            next_beams += [r * k + parent for parent in parents]
            next_tokens += tokens
        if not still_open:
            break
        cache = out.cache.select(np.asarray(next_beams))
        if len(still_open) < len(open_rows):  # closed rows leave; beams of one row share the source
            kept = [open_rows.index(row) for row in still_open]
            state = state.select(np.asarray([r * k + j for r in kept for j in range(k)]))
        last = np.asarray(next_tokens, dtype=np.int64)[:, None]
        open_rows = still_open
    return [row.result() for row in rows]


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
