"""Continuous (iteration-level) batching of greedy decoding: rows join between decoder steps.

A `RunningBatch` holds the rows now decoding. Between two decoder steps, new rows join (`add`:
one encoder call for the newcomers; their cross keys/values are padded to the batch's source
length and their self-attention cache is padded with masked positions), and a row leaves as
soon as it finishes (`step` returns it). Each row keeps its own decoder positions (0, 1, ...
from its own first step) and a (B, P) `target_mask` marks which cached positions are its own,
so it decodes the tokens it would decode alone: masked keys get exactly zero weight. Cache
columns that no remaining row uses (and source columns past the longest remaining source) are
trimmed when rows leave, so the cache is as long as the oldest row's output, not as long as the
batch has been running. TGI's `Seq2SeqLMBatch.concatenate` / `filter` follow the same idea.

The rules of a row are those of `service.generation.greedy`: at most `max_new_tokens` tokens,
EOS included; finish_reason "eos", "length" or "cancelled" (its hook's flag, seen between
steps); `on_token` is called for every token kept. One caveat: with dynamically quantized
(int8) graphs a row's activations are quantized with the whole batch's scale, so its tokens
may depend on its neighbours -- as with any batching of those graphs.

The state lives in host (numpy) arrays: with IO binding, device tensors come to the host when
rows join or leave (CPU: free, they share memory; CUDA: a copy -- device-side padding is not
written yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from service.generation import GenerationResult, RowHooks, Runtime, log_softmax
from service.runtime import EncoderState, KVCache, to_numpy

Owner = TypeVar("Owner")


@dataclass(eq=False)
class _Member(Generic[Owner]):
    """One row of the running batch and what it has decoded so far."""

    owner: Owner
    max_new_tokens: int
    hooks: RowHooks | None
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0


class RunningBatch(Generic[Owner]):
    """The rows decoding together; `add` rows, call `step` until it is empty."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._members: list[_Member[Owner]] = []
        self._source_mask = np.zeros((0, 0), dtype=bool)  # (B, S) True on real source tokens
        self._cross_keys: list[np.ndarray] = []  # per decoder layer (B, h, S, d)
        self._cross_values: list[np.ndarray] = []
        self._keys: list[np.ndarray] = []  # per decoder layer (B, h, P, d)
        self._values: list[np.ndarray] = []
        self._target_mask = np.zeros((0, 0), dtype=bool)  # (B, P) True on a row's own positions
        self._positions = np.zeros(0, dtype=np.int64)  # (B,) the position of each row's next input
        self._last = np.zeros(0, dtype=np.int64)  # (B,) each row's next input token

    def __len__(self) -> int:
        return len(self._members)

    @property
    def owners(self) -> list[Owner]:
        """The owner of each row, in batch order."""
        return [member.owner for member in self._members]

    @property
    def source_len(self) -> int:
        """The padded source length of the batch (0 when empty)."""
        return int(self._source_mask.shape[1])

    @property
    def cache_len(self) -> int:
        """Cached decoder positions per row (0 when empty)."""
        return int(self._target_mask.shape[1])

    def add(
        self,
        sources: Sequence[list[int]],
        owners: Sequence[Owner],
        max_new_tokens: Sequence[int],
        hooks: Sequence[RowHooks | None] | None = None,
    ) -> None:
        """Encode `sources` (ids ending with EOS) and join them to the batch before the next step."""
        if not sources:
            return
        if len(owners) != len(sources) or len(max_new_tokens) != len(sources):
            raise ValueError("one owner and one max_new_tokens per source")
        if any(not source for source in sources) or min(max_new_tokens) < 1:
            raise ValueError("every source needs its EOS and max_new_tokens >= 1")
        hooks = hooks if hooks is not None else [None] * len(sources)
        state = self.runtime.encode(self.runtime.pad(list(sources)))
        self._join_state(state)
        self._join_cache(len(sources))
        self._members += [_Member(owner, limit, hook)
                          for owner, limit, hook in zip(owners, max_new_tokens, hooks, strict=True)]

    def step(self) -> list[tuple[Owner, GenerationResult]]:
        """One decoder step for every row; returns the rows that finished (they have left)."""
        if not self._members:
            return []
        batch = len(self._members)
        target_mask = np.concatenate([self._target_mask, np.ones((batch, 1), dtype=bool)], axis=1)
        state = EncoderState(self._source_mask, list(self._cross_keys), list(self._cross_values))
        cache = KVCache(list(self._keys), list(self._values))
        out = self.runtime.decode(self._last[:, None], state, cache,
                                  positions=self._positions[:, None], target_mask=target_mask)
        log_probs = log_softmax(out.logits[:, -1])  # (B, V)
        best = log_probs.argmax(axis=-1)  # (B,)
        chosen = log_probs[np.arange(batch), best]  # (B,)
        finished: list[tuple[Owner, GenerationResult]] = []
        keep: list[int] = []
        eos = self.runtime.eos_id
        for i, member in enumerate(self._members):
            token = int(best[i])
            member.score += float(chosen[i])
            if token == eos:
                finished.append((member.owner, GenerationResult(member.tokens, "eos", member.score)))
                continue
            member.tokens.append(token)
            if member.hooks is not None and member.hooks.on_token is not None:
                member.hooks.on_token(token)
            if len(member.tokens) >= member.max_new_tokens:
                finished.append((member.owner, GenerationResult(member.tokens, "length", member.score)))
            elif member.hooks is not None and member.hooks.cancelled:
                finished.append((member.owner, GenerationResult(member.tokens, "cancelled", member.score)))
            else:
                keep.append(i)
        self._keys = [to_numpy(k) for k in out.cache.keys]
        self._values = [to_numpy(v) for v in out.cache.values]
        self._target_mask = target_mask
        self._positions = self._positions + 1
        self._last = best.astype(np.int64)
        if len(keep) < batch:
            self._keep(np.asarray(keep, dtype=np.int64))
        return finished

    def cancel_all(self) -> list[Owner]:
        """Drop every row (the batch failed); returns their owners."""
        owners = self.owners
        self._keep(np.zeros(0, dtype=np.int64))
        return owners

    # -- joining and leaving ---------------------------------------------------------------

    def _join_state(self, state: EncoderState) -> None:
        """Append the newcomers' encoder state, padding both sides to the longer source."""
        new_keys = [to_numpy(k) for k in state.cross_keys]
        new_values = [to_numpy(v) for v in state.cross_values]
        if not self._members:
            self._source_mask, self._cross_keys, self._cross_values = state.source_mask, new_keys, new_values
            return
        length = max(self.source_len, state.source_mask.shape[1])
        self._source_mask = np.concatenate(
            [_pad_axis(self._source_mask, 1, length), _pad_axis(state.source_mask, 1, length)])
        self._cross_keys = [np.concatenate([_pad_axis(old, 2, length), _pad_axis(new, 2, length)])
                            for old, new in zip(self._cross_keys, new_keys, strict=True)]
        self._cross_values = [np.concatenate([_pad_axis(old, 2, length), _pad_axis(new, 2, length)])
                              for old, new in zip(self._cross_values, new_values, strict=True)]

    def _join_cache(self, count: int) -> None:
        """Give the newcomers `cache_len` masked cache positions, position 0 and BOS."""
        past = self.cache_len if self._members else 0
        runtime = self.runtime
        if not self._members:
            empty = runtime.empty_cache(count)  # type: ignore[attr-defined]
            self._keys, self._values = [to_numpy(k) for k in empty.keys], [to_numpy(v) for v in empty.values]
            self._target_mask = np.zeros((count, 0), dtype=bool)
            self._positions = np.zeros(count, dtype=np.int64)
            self._last = np.full(count, runtime.bos_id, dtype=np.int64)
            return
        blank = np.zeros((count, *self._keys[0].shape[1:]), dtype=self._keys[0].dtype)  # (n, h, P, d)
        self._keys = [np.concatenate([k, blank]) for k in self._keys]
        self._values = [np.concatenate([v, blank]) for v in self._values]
        self._target_mask = np.concatenate([self._target_mask, np.zeros((count, past), dtype=bool)])
        self._positions = np.concatenate([self._positions, np.zeros(count, dtype=np.int64)])
        self._last = np.concatenate([self._last, np.full(count, runtime.bos_id, dtype=np.int64)])

    def _keep(self, rows: np.ndarray) -> None:
        """Keep only `rows`; trim cache and source columns no kept row uses."""
        self._members = [self._members[i] for i in rows.tolist()]
        target_mask, source_mask = self._target_mask[rows], self._source_mask[rows]
        used = np.flatnonzero(target_mask.any(axis=0))
        first = int(used[0]) if used.size else target_mask.shape[1]  # older columns: rows that left
        used_source = np.flatnonzero(source_mask.any(axis=0))
        end = int(used_source[-1]) + 1 if used_source.size else 0  # later columns: padding only
        self._target_mask = target_mask[:, first:]
        self._source_mask = source_mask[:, :end]
        self._keys = [np.ascontiguousarray(k[rows, :, first:]) for k in self._keys]
        self._values = [np.ascontiguousarray(v[rows, :, first:]) for v in self._values]
        self._cross_keys = [np.ascontiguousarray(k[rows, :, :end]) for k in self._cross_keys]
        self._cross_values = [np.ascontiguousarray(v[rows, :, :end]) for v in self._cross_values]
        self._positions, self._last = self._positions[rows], self._last[rows]


def _pad_axis(array: np.ndarray, axis: int, length: int) -> np.ndarray:
    """`array` zero/False-padded at the end of `axis` to `length`."""
    missing = length - array.shape[axis]
    if missing <= 0:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, missing)
    return np.pad(array, widths)
