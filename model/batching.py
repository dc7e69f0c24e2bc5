"""Tokenized parallel examples and token-budget batches sorted by length."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from model.decoding import pad_batch


@dataclass
class ParallelExamples:
    """Source and target id sequences (no BOS/EOS yet), already cut to the maximum lengths."""

    sources: list[list[int]]
    targets: list[list[int]]

    def __len__(self) -> int:
        return len(self.sources)

    def target_tokens(self) -> int:
        """Target tokens the model predicts per epoch (EOS included)."""
        return sum(len(t) + 1 for t in self.targets)


@dataclass
class Batch:
    source: Tensor  # (B, S) right-padded
    target_input: Tensor  # (B, T) BOS + target, right-padded
    target_output: Tensor  # (B, T) target + EOS, right-padded

    @property
    def n_target_tokens(self) -> int:
        return int((self.target_output != 0).sum())


def make_batch(sources: list[list[int]], targets: list[list[int]], pad_id: int, bos_id: int, eos_id: int) -> Batch:
    return Batch(
        source=pad_batch([s + [eos_id] for s in sources], pad_id),
        target_input=pad_batch([[bos_id] + t for t in targets], pad_id),
        target_output=pad_batch([t + [eos_id] for t in targets], pad_id),
    )


def token_budget_batches(examples: ParallelExamples, max_tokens: int, seed: int) -> list[list[int]]:
    """Index lists of batches whose padded size (rows x longest side) stays within `max_tokens`.

    Examples are sorted by length (ties broken by a seeded shuffle) so padding is small; the batch
    order is then shuffled with the same seed. Deterministic for a given seed.
    """
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    order.sort(key=lambda i: (len(examples.targets[i]), len(examples.sources[i])))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        size = max(len(examples.sources[index]), len(examples.targets[index])) + 1
        if current and max(longest, size) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, size)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def iterate_batches(
    examples: ParallelExamples, indices: list[list[int]], pad_id: int, bos_id: int, eos_id: int
) -> Iterator[Batch]:
    for batch in indices:
        yield make_batch(
            [examples.sources[i] for i in batch], [examples.targets[i] for i in batch], pad_id, bos_id, eos_id
        )


def to_device(batch: Batch, device: torch.device) -> Batch:
    return Batch(batch.source.to(device), batch.target_input.to(device), batch.target_output.to(device))
