"""Reference generation in PyTorch: batched greedy and beam search with per-row stopping.

The service's onnxruntime generation loop must produce exactly these tokens; its tests compare
against these functions. Conventions shared with it:
- outputs exclude BOS and EOS; `finish_reason` is "eos" or "length";
- at most `max_new_tokens` tokens are generated per row, EOS included;
- beam search scores a hypothesis by its summed log-probability divided by
  (generated length including EOS) ** length_penalty, keeps EOS candidates only when they rank
  within the top `beam_size` candidates of the step, and ends a row once it holds `beam_size`
  finished hypotheses (fairseq's rule); rows still open at the limit finish with "length".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.stopping import EOS, StoppingCriteria
from model.transformer import DecoderCache, Transformer


@dataclass(frozen=True)
class Generation:
    """One generated sequence."""

    tokens: list[int]
    finish_reason: str  # "eos" | "length"
    score: float = 0.0  # sum of log-probabilities (greedy) or the normalised beam score


def pad_batch(sequences: list[list[int]], pad_id: int) -> Tensor:
    """Right-pad id lists into a (B, S) tensor."""
    width = max(len(s) for s in sequences)
    batch = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        batch[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
    return batch


@torch.no_grad()
def greedy_decode(
    model: Transformer, source: Tensor, max_new_tokens: int, use_cache: bool = True
) -> list[Generation]:
    """Greedy decoding of a (B, S) right-padded source batch; finished rows leave the batch.

    With `use_cache=False` every step re-runs the decoder on the whole prefix (the slow
    reference the cache is checked against).
    """
    config = model.config
    stop = StoppingCriteria(config.eos_id, max_new_tokens)
    encoded = model.encode(source, need_weights=False)
    start = model.start_decoding(encoded)
    batch = source.size(0)
    results: list[Generation | None] = [None] * batch
    tokens: list[list[int]] = [[] for _ in range(batch)]
    scores = [0.0] * batch
    device = source.device
    active = torch.arange(batch, device=device)  # original row index of each row still decoding
    cache = start
    prefix = torch.full((batch, 1), config.start_id, dtype=torch.long, device=device)  # (B_active, t+1)
    for step in range(max_new_tokens):
        if use_cache:
            output = model.decode(prefix[:, -1:], cache, need_weights=False)
            cache = output.cache
        else:
            output = model.decode(prefix, start.select(active), need_weights=False)
        log_probs = output.logits[:, -1].float().log_softmax(dim=-1)  # (B_active, V)
        best_scores, best = log_probs.max(dim=-1)  # (B_active,)
        keep = []
        for i, row in enumerate(active.tolist()):
            token = int(best[i])
            scores[row] += float(best_scores[i])
            reason = stop(token, len(tokens[row]))
            if reason != EOS:
                tokens[row].append(token)
            if reason is not None:
                results[row] = Generation(tokens[row], reason, scores[row])
            else:
                keep.append(i)
        if not keep:
            break
        rows = torch.tensor(keep, dtype=torch.long, device=device)
        active = active.index_select(0, rows)
        prefix = torch.cat([prefix.index_select(0, rows), best.index_select(0, rows)[:, None]], dim=1)
        if use_cache:
            cache = cache.select(rows)
    return [r if r is not None else Generation([], "length") for r in results]


@torch.no_grad()
def beam_search(
    model: Transformer,
    source: Tensor,
    beam_size: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
) -> list[Generation]:
    """Batched beam search over a (B, S) source batch; each row stops on its own."""
    if beam_size == 1:
        return greedy_decode(model, source, max_new_tokens)
    config = model.config
    batch, k = source.size(0), beam_size
    encoded = model.encode(source, need_weights=False)
    rows_of = torch.arange(batch).repeat_interleave(k)  # (B*K,) source row of each beam
    cache: DecoderCache = model.start_decoding(encoded).select(rows_of)
    beam_tokens: list[list[int]] = [[] for _ in range(batch * k)]
    beam_scores = torch.zeros(batch, k)
    beam_scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
    last = torch.full((batch * k, 1), config.start_id, dtype=torch.long)
    finished: list[list[Generation]] = [[] for _ in range(batch)]
    open_rows = list(range(batch))  # source rows still searching; beams of row b sit at b*k..b*k+k-1
    for step in range(max_new_tokens):
        output = model.decode(last, cache, need_weights=False)
        log_probs = output.logits[:, -1].float().log_softmax(dim=-1)  # (R*K, V)
        vocab = log_probs.size(-1)
        candidates = (beam_scores[open_rows].reshape(-1, 1) + log_probs).view(len(open_rows), k * vocab)
        top_scores, top_index = candidates.topk(2 * k, dim=-1)  # (R, 2K)
        length = step + 1
        next_rows, next_tokens, next_scores, next_beams, still_open = [], [], [], [], []
        for r, row in enumerate(open_rows):
            alive: list[tuple[int, int, float]] = []  # (beam position in batch, token, score)
            for rank in range(2 * k):
                beam = r * k + int(top_index[r, rank]) // vocab
                token = int(top_index[r, rank]) % vocab
                score = float(top_scores[r, rank])
                if token == config.eos_id:
                    if rank < k and len(finished[row]) < k:
                        normalised = score / length**length_penalty
                        finished[row].append(Generation(list(beam_tokens[beam]), "eos", normalised))
                elif len(alive) < k:
                    alive.append((beam, token, score))
            if len(finished[row]) >= k:
                continue
            if step == max_new_tokens - 1:
                for beam, token, score in alive[: k - len(finished[row])]:
                    normalised = score / length**length_penalty
                    finished[row].append(Generation(beam_tokens[beam] + [token], "length", normalised))
                continue
            still_open.append(row)
            for beam, token, score in alive:
                next_beams.append(beam)
                next_tokens.append(token)
                next_scores.append(score)
            next_rows.append(row)
        if not still_open:
            break
        beams = torch.tensor(next_beams, dtype=torch.long)
        cache = output.cache.select(beams)
        beam_tokens = [beam_tokens[b] + [t] for b, t in zip(next_beams, next_tokens, strict=True)]
        beam_scores[still_open] = torch.tensor(next_scores).view(len(still_open), k)
        last = torch.tensor(next_tokens, dtype=torch.long)[:, None]
        open_rows = still_open
    return [max(hyps, key=lambda g: g.score) for hyps in finished]
