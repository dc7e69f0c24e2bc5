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

Only the pieces a row keeps are sorted: for `top_p` the 64 most likely are found first (a
partition of the row), then eight times as many while they hold less than `top_p` of the
probability; without `top_k` and `top_p` nothing is sorted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.generation.search import top_k

NUCLEUS_FIRST = 64  # pieces looked at first for top_p; eight times as many while they hold less


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
        ids, probs = kept(logits, self.settings)
        cumulative = np.cumsum(probs, dtype=np.float64)
        drawn = int(np.searchsorted(cumulative, self.generator.random() * cumulative[-1], side="right"))
        return int(ids[min(drawn, len(ids) - 1)])


def kept(logits: np.ndarray, settings: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """The pieces a row may draw from one step's (V,) `logits` and their probabilities
    renormalised over them (float64, summing to 1): with `top_k` or `top_p`, most likely first
    (ties by id); with neither, every piece in id order (the draw needs no order)."""
    scaled = logits.astype(np.float64) / settings.temperature
    size = scaled.shape[-1]
    k = size if settings.top_k is None else min(settings.top_k, size)
    weights = np.exp(scaled - scaled.max())  # (V,), the largest 1
    if k == size and settings.top_p >= 1:
        return np.arange(size), weights / weights.sum()
    if settings.top_p >= 1:
        ids = _most_likely(scaled, k)
    else:
        total = weights.sum() if k == size else weights[_most_likely(scaled, k)].sum()  # the top-k's mass
        first = min(k, NUCLEUS_FIRST)
        while True:  # the most likely `first` pieces, growing eightfold until they hold top_p
            ids = _most_likely(scaled, first)
            mass = np.cumsum(weights[ids]) / total
            if mass[-1] >= settings.top_p or first == k:
                break
            first = min(k, first * 8)
        cut = int(np.searchsorted(mass, settings.top_p, side="left")) + 1  # the piece that reaches top_p
        ids = ids[:min(cut, len(ids))]
    probs = weights[ids]
    return ids, probs / probs.sum()


def _most_likely(scaled: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest of (V,) `scaled`, largest first, equal values by id."""
    if k >= scaled.shape[-1]:
        return np.argsort(-scaled, kind="stable")
    return top_k(scaled[None], k)[1][0]
