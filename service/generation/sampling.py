"""Sampling a row's next token instead of taking the argmax: temperature, top-k, top-p, seed.

The rule, per row and step, over the model's logits `z` (one per vocabulary piece):
- divide by `temperature` (> 0): p ∝ exp(z / temperature); below 1 sharper, above 1 flatter;
- `top_k`: keep the k most likely pieces (ties broken by piece id);
- `top_p`: then keep the smallest set of the most likely pieces whose probability, renormalised
  over what is kept, reaches `top_p` (nucleus sampling; the piece that crosses it is kept);
- draw one piece from what is left, in proportion to its probability.

`seed` makes a row's draws repeatable: text `i` of a request draws from a generator seeded with
`(seed, i)`, so a request sent again with the same seed gets the same outputs, and its texts
differ from one another. Without a seed each row's generator is seeded from the operating
system. The draws are repeatable; the logits they draw from are the model's, so with int8
graphs, whose activations are quantized with the whole batch's scale, a row's logits (and so,
rarely, a draw) may depend on the rows decoding beside it (`service.batching.slot_batch`).

The rows of a step that share their settings are drawn together (`draw`): the exponentials,
the top k (`service.generation.ranking`) and the draws of all of them at once. Nothing is
sorted whole: with `top_k` only the k most likely are ranked (and with `top_k` alone only they
are exponentiated); with `top_p` alone the 64 most likely, which hold the nucleus of most rows,
and for a row whose nucleus is wider only the pieces that may be in it (each weighs at least
(1 - top_p) / V of the row); with neither nothing is ranked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.generation.ranking import top_k

NUCLEUS_FIRST = 64  # top_p: the most likely pieces looked at first, enough for most rows
DRAW_BLOCK = 64  # a draw over a long row finds its block of this many pieces first


@dataclass(frozen=True)
class Sampling:
    """A request's sampling settings (temperature > 0; top_k None or >= 1; 0 < top_p <= 1)."""

    temperature: float
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0 or not np.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    def sampler(self, row: int) -> Sampler:
        """The sampler of the request's `row`-th row: its own generator, seeded with
        (seed, row) when the request has a seed."""
        entropy = None if self.seed is None else [self.seed, row]
        return Sampler(self, np.random.default_rng(entropy))


class Sampler:
    """One row's draws: its settings and its generator (used in one thread at a time)."""

    def __init__(self, settings: Sampling, generator: np.random.Generator) -> None:
        self.settings = settings
        self.generator = generator

    def sample(self, logits: np.ndarray) -> int:
        """A piece drawn from one row's (V,) `logits` by the module's rule."""
        return int(draw(logits[None], [self])[0])


def draw(logits: np.ndarray, samplers: Sequence[Sampler]) -> np.ndarray:
    """One piece per row of (R, V) `logits`, row i drawn by `samplers[i]` (one uniform number of
    its generator per draw). The rows of the same temperature, top_k and top_p are drawn
    together (their seeds may differ); every operation is the row's own, so a row draws the same
    piece from the same logits and generator state whatever rows are drawn beside it."""
    tokens = np.empty(len(samplers), dtype=np.int64)
    groups: dict[tuple[float, int | None, float], list[int]] = {}
    for i, sampler in enumerate(samplers):
        settings = sampler.settings
        groups.setdefault((settings.temperature, settings.top_k, settings.top_p), []).append(i)
    for rows in groups.values():
        settings = samplers[rows[0]].settings
        index = np.asarray(rows, dtype=np.int64)
        ids, weights = kept_rows(logits[index], settings)  # (r, m) each
        chances = np.asarray([samplers[i].generator.random() for i in rows])  # (r,) in [0, 1)
        # by blocks whenever the width depends on the rows drawn together (the nuclei's), so
        # that a row's sums do not depend on them either
        drawn = _inverse_cdf(weights, chances, blocked=settings.top_p < 1 or weights.shape[-1] > 4 * DRAW_BLOCK)
        tokens[index] = drawn if ids is None else np.take_along_axis(ids, drawn[:, None], axis=-1)[:, 0]
    return tokens


def _inverse_cdf(weights: np.ndarray, chances: np.ndarray, blocked: bool) -> np.ndarray:
    """For each row of (R, m) `weights` (>= 0, not normalised), the first column whose running
    sum exceeds `chances` x the row's total. `blocked`: the row is summed in blocks of
    `DRAW_BLOCK` first, then only the block the draw falls in column by column (a running sum
    along a long axis costs more than the two short ones; trailing zero weights change neither
    sum); else in one running sum."""
    rows, size = weights.shape
    if not blocked:
        running = np.cumsum(weights, axis=-1, dtype=np.float64)
        goal = chances * running[:, -1]
        return np.minimum((running <= goal[:, None]).sum(axis=-1), size - 1)
    blocks = -(-size // DRAW_BLOCK)
    if blocks * DRAW_BLOCK != size:
        weights = np.pad(weights, ((0, 0), (0, blocks * DRAW_BLOCK - size)))
    grouped = weights.reshape(rows, blocks, DRAW_BLOCK)
    block_sums = grouped.sum(axis=-1, dtype=np.float64)  # (R, blocks)
    running = np.cumsum(block_sums, axis=-1)
    goal = chances * running[:, -1]
    block = np.minimum((running <= goal[:, None]).sum(axis=-1), blocks - 1)  # (R,)
    line = np.arange(rows)
    inner = (running[line, block] - block_sums[line, block])[:, None] + np.cumsum(
        grouped[line, block], axis=-1, dtype=np.float64)  # (R, DRAW_BLOCK)
    column = np.minimum((inner <= goal[:, None]).sum(axis=-1), DRAW_BLOCK - 1)
    return np.minimum(block * DRAW_BLOCK + column, size - 1)


def kept(logits: np.ndarray, settings: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """The pieces one row may draw from one step's (V,) `logits` and their probabilities
    (float64, summing to 1): `kept_rows` of that row alone, which pads nothing."""
    ids, weights = kept_rows(logits[None], settings)
    probs = weights[0].astype(np.float64)
    if settings.top_p < 1:  # the pieces past the nucleus weigh 0
        probs = probs[:int(np.flatnonzero(probs)[-1]) + 1]
    return (np.arange(len(probs)) if ids is None else ids[0, :len(probs)]), probs / probs.sum()


def kept_rows(logits: np.ndarray, settings: Sampling) -> tuple[np.ndarray | None, np.ndarray]:
    """The pieces each row of (R, V) `logits` may draw from and their weights (proportional to
    their probabilities at the temperature, not normalised), as (R, m) arrays: with `top_k` or
    `top_p`, most likely first (ties by id), rows keeping fewer than m pieces padded with weight
    0; with neither, every piece in id order (ids None: the draw needs no order)."""
    rows, size = logits.shape
    k = size if settings.top_k is None else min(settings.top_k, size)
    if settings.top_p >= 1 and k < size:  # the k most likely: only their exponentials
        values, ids = top_k(logits, k)
        return ids, np.exp((values.astype(np.float64) - values[:, :1]) / settings.temperature)
    if settings.top_p >= 1:  # every piece: float32 exponentials, summed in float64
        return None, np.exp((logits - logits.max(axis=-1, keepdims=True)) / np.float32(settings.temperature))
    # float32 exponentials (the order is the logits'), their sums in float64
    weights = np.exp((logits - logits.max(axis=-1, keepdims=True)) / np.float32(settings.temperature))
    line = np.arange(rows)[:, None]
    if k < size:  # the nucleus of the top k: their order is top_k's
        ids = top_k(logits, k)[1]  # (R, k)
        kept_weights = weights[line, ids]
        mass = np.cumsum(kept_weights, axis=-1, dtype=np.float64)
        cuts = (mass < settings.top_p * mass[:, -1:]).sum(axis=-1) + 1  # (R,) the piece that reaches top_p kept
        kept_weights[np.arange(k) >= cuts[:, None]] = 0
        return ids, kept_weights
    totals = weights.sum(axis=-1, dtype=np.float64)  # (R,)
    first = min(NUCLEUS_FIRST, size)
    ids = top_k(logits, first)[1]  # (R, first): the nucleus of most rows
    mass = np.cumsum(weights[line, ids], axis=-1, dtype=np.float64)
    cuts = (mass < settings.top_p * totals[:, None]).sum(axis=-1) + 1  # (R,)
    chosen = [ids[row, :cuts[row]] for row in range(rows)]
    # the rows whose nucleus is wider: every piece of a nucleus weighs at least (1 - top_p) / V
    # of the total (the lighter ones weigh less than 1 - top_p together), so only those are sorted
    floors = (1 - settings.top_p) / size * totals / 2
    for row in np.flatnonzero(cuts > first).tolist():
        candidates = np.flatnonzero(weights[row] >= floors[row])  # ascending: ties stay in id order
        ids_row = candidates[np.argsort(-logits[row, candidates], kind="stable")]
        mass_row = np.cumsum(weights[row, ids_row], dtype=np.float64)
        chosen[row] = ids_row[:min(int((mass_row < settings.top_p * totals[row]).sum()) + 1, len(ids_row))]
    width = max(len(ids) for ids in chosen)
    kept_ids = np.zeros((rows, width), dtype=np.int64)
    kept_weights = np.zeros((rows, width), dtype=np.float32)
    for row, ids in enumerate(chosen):
        kept_ids[row, :len(ids)] = ids
        kept_weights[row, :len(ids)] = weights[row, ids]
    return kept_ids, kept_weights
