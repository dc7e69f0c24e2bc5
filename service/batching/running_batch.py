"""Continuous (iteration-level) batching of greedy decoding on the merged decoder: rows join
between decoder steps.

The service uses it for a model without a step graph (`decoder_step.onnx`); with one it uses
`service.batching.slot_batch.SlotBatch`, which keeps each row's cache in its own slot and needs none of
the padding, trimming and copying below. Both implement `service.batching.in_flight`'s contract.

A `RunningBatch` holds the rows now decoding. Between two decoder steps, new rows join (`concatenate`:
one encoder call for the newcomers; their cross keys/values are padded to the batch's source
length and their self-attention cache is padded with masked positions), and a row leaves as
soon as it finishes (`generate_token` returns it). Each row keeps its own decoder positions (0, 1, ...
from its own first step) and a (B, P) `target_mask` marks which cached positions are its own,
so it decodes the tokens it would decode alone: masked keys get exactly zero weight. Cache
columns that no remaining row uses (and source columns past the longest remaining source) are
trimmed when rows leave, so the cache is as long as the oldest row's output, not as long as the
batch has been running. TGI's `Seq2SeqLMBatch.concatenate` / `filter` follow the same idea.

A row stops by `model.stopping.StoppingCriteria`, as in `service.generation.search.greedy`:
EOS, its `max_new_tokens`, or its hook's cancel flag (seen between steps); `on_token` is
called for every token kept. One caveat: with dynamically quantized
(int8) graphs a row's activations are quantized with the whole batch's scale, so its tokens
may depend on its neighbours -- as with any batching of those graphs.

The state lives in host (numpy) arrays: with IO binding, the decoder's new cache comes to the
host after every step (CPU: free, they share memory; CUDA: a copy per step, so IO binding gains
nothing here until joining and compaction run on the device -- not written yet).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Generic

import numpy as np

from service.batching.in_flight import Member, Owner, advance, choose, encode_newcomers
from service.generation.hooks import RowHooks
from service.generation.search import GenerationResult
from service.runtime import EncoderState, KVCache, to_numpy
from service.runtime.protocol import Runtime


class RunningBatch(Generic[Owner]):
    """The rows decoding together on the merged decoder (`service.batching.in_flight`'s contract):
    `concatenate` rows, call `generate_token` until it is empty.

    A finished row leaves the results at once but its slot stays in the arrays (decoding
    padding, its outputs ignored). Newcomers take dead slots in place, writing only their own
    rows, while there are enough and no cache columns to trim; otherwise, and when a quarter
    of the slots are dead, one copy compacts the batch, trims unused columns and appends the
    newcomers. That keeps the full-cache copies well under one per join.
    """

    pads_to_oldest = True  # a newcomer's cache is padded to the oldest row's length
    takes_beams = False  # greedy rows only: beam-search rows run in request-level batches

    def __init__(self, runtime: Runtime, compact_fraction: float = 0.25, padding_slack: float = 1.25,
                 trim_slack: int = 4, scores: bool = True) -> None:
        self.runtime = runtime
        self.scores = scores  # results carry their summed log-probability (else None: no log-softmax per step)
        self.compact_fraction = compact_fraction
        self.trim_slack = trim_slack  # newcomers fill dead slots only while at most this many cache columns are unused
        self.padding_slack = padding_slack  # newcomers are encoded in groups of similar length
        self._members: list[Member[Owner] | None] = []  # None: a dead slot
        self._source_mask = np.zeros((0, 0), dtype=bool)  # (B, S) True on real source tokens
        self._cross_keys: list[np.ndarray] = []  # per decoder layer (B, h, S, d)
        self._cross_values: list[np.ndarray] = []
        self._keys: list[np.ndarray] = []  # per decoder layer (B, h, P, d)
        self._values: list[np.ndarray] = []
        self._target_mask = np.zeros((0, 0), dtype=bool)  # (B, P) True on a row's own positions
        self._positions = np.zeros(0, dtype=np.int64)  # (B,) the position of each row's next input
        self._last = np.zeros(0, dtype=np.int64)  # (B,) each row's next input token

    def __len__(self) -> int:
        """Rows still decoding (dead slots excluded)."""
        return sum(member is not None for member in self._members)

    @property
    def slots(self) -> int:
        """Rows of the arrays, dead slots included."""
        return len(self._members)

    @property
    def cache_bytes(self) -> int:
        """Bytes of its cache and cross keys/values (dead slots included)."""
        return sum(array.nbytes for array in (*self._keys, *self._values, *self._cross_keys, *self._cross_values))

    @property
    def owners(self) -> list[Owner]:
        """The owner of each live row, in batch order."""
        return [member.owner for member in self._members if member is not None]

    @property
    def source_len(self) -> int:
        """The padded source length of the batch (0 when empty)."""
        return int(self._source_mask.shape[1])

    @property
    def oldest_age(self) -> int:
        """Decoder steps the oldest live row has run (0 when empty): the cache a newcomer would
        be padded to, once the columns of finished rows are trimmed at the join."""
        return max((len(m.tokens) for m in list(self._members) if m is not None), default=0)

    @property
    def cache_len(self) -> int:
        """Cached decoder positions per row (0 when empty)."""
        return int(self._target_mask.shape[1])

    def concatenate(
        self,
        sources: Sequence[list[int]],
        owners: Sequence[Owner],
        max_new_tokens: Sequence[int],
        hooks: Sequence[RowHooks | None] | None = None,
        beam_sizes: Sequence[int] | None = None,
    ) -> None:
        """Encode `sources` (ids ending with EOS) and join them to the batch before the next
        step; greedy rows only (`beam_sizes` all 1)."""
        if beam_sizes is not None and any(k != 1 for k in beam_sizes):
            raise ValueError("RunningBatch decodes greedy rows only")
        if not sources:
            return
        states, members = encode_newcomers(self.runtime, sources, owners, max_new_tokens, hooks, self.padding_slack)
        if not self._fill_dead_slots(states, members):
            self._rebuild(states)
            self._members += members

    def generate_token(self) -> list[tuple[Owner, GenerationResult]]:
        """One decoder step for every row; returns the rows that finished (they have left)."""
        if not len(self):
            return []
        batch = self.slots
        target_mask = np.concatenate([self._target_mask, np.ones((batch, 1), dtype=bool)], axis=1)
        state = EncoderState(self._source_mask, self._cross_keys, self._cross_values)
        cache = KVCache(self._keys, self._values)
        out = self.runtime.decode(self._last[:, None], state, cache,
                                  positions=self._positions[:, None], target_mask=target_mask)
        best, chosen = choose(self._members, out.logits[:, -1], self.scores)  # (B,) each
        finished = advance(self._members, best, chosen, self.runtime.eos_id, self.scores)
        for i, _ in finished:
            self._members[i] = None
        self._keys = [to_numpy(k) for k in out.cache.keys]
        self._values = [to_numpy(v) for v in out.cache.values]
        self._target_mask = target_mask
        self._positions = self._positions + 1
        self._last = best.astype(np.int64)
        live = len(self)
        if not live:
            self._members = []
        elif self.slots - live > self.compact_fraction * self.slots:
            self._rebuild([])
        return [result for _, result in finished]

    def filter(self, owners: Collection[Owner]) -> list[Owner]:
        """Keep only the rows of `owners`; the others leave at once (their slots go dead, as a
        finished row's); returns the owners that left."""
        gone = [i for i, m in enumerate(self._members) if m is not None and m.owner not in owners]
        left = [m.owner for i in gone if (m := self._members[i]) is not None]
        for i in gone:
            self._members[i] = None
        if not len(self):
            self._members = []
        return left

    def _fill_dead_slots(self, newcomers: list[EncoderState], members: list[Member[Owner]]) -> bool:
        """Put the newcomers into dead slots in place, without copying the batch, when there
        are enough, at most `trim_slack` cache columns are unused and no newcomer's source is
        longer than the batch's; False if not (then `_rebuild` does it). A slot's old cache positions are masked for its newcomer, as the
        padding positions a rebuild gives it are, so it decodes the same tokens."""
        dead = [i for i, member in enumerate(self._members) if member is None]
        if (len(dead) < len(members) or self.cache_len - self.oldest_age > self.trim_slack
                or any(state.source_mask.shape[1] > self.source_len for state in newcomers)):
            return False  # too few slots, columns to trim, or a longer source: copy the batch
        start = 0
        for state in newcomers:  # a group encoded together: (count, width) sources
            count, width = state.source_mask.shape
            rows = np.asarray(dead[start:start + count], dtype=np.int64)
            start += count
            for layer, (keys, values) in enumerate(zip(state.cross_keys, state.cross_values, strict=True)):
                for target, new in ((self._cross_keys[layer], to_numpy(keys)),
                                    (self._cross_values[layer], to_numpy(values))):
                    target[rows] = 0  # (count, h, S, d)
                    target[rows, :, :width] = new
                self._keys[layer][rows] = 0  # (count, h, P, d): masked, cleared all the same
                self._values[layer][rows] = 0
            self._source_mask[rows] = False
            self._source_mask[rows, :width] = state.source_mask
            self._target_mask[rows] = False
            self._positions[rows] = 0
            self._last[rows] = self.runtime.decoder_start_id
        for slot, member in zip(dead, members, strict=False):
            self._members[slot] = member
        return True

    def _rebuild(self, newcomers: list[EncoderState]) -> None:
        """One copy of every array: live rows kept, columns no live row uses trimmed, the
        newcomers (encoded in groups) appended: cross keys/values padded to the longest source,
        cache positions masked, position 0, the start token."""
        keep = np.asarray([i for i, m in enumerate(self._members) if m is not None], dtype=np.int64)
        self._members = [m for m in self._members if m is not None]
        kept = len(keep)
        count = sum(state.source_mask.shape[0] for state in newcomers)
        rows = kept + count
        if kept:  # cache columns from the oldest live row's first position, source to the longest
            used = np.flatnonzero(self._target_mask[keep].any(axis=0))
            first = int(used[0]) if used.size else self.cache_len
            used_source = np.flatnonzero(self._source_mask[keep].any(axis=0))
            end = int(used_source[-1]) + 1 if used_source.size else 0
        else:
            first, end = self.cache_len, 0
        past = self.cache_len - first if kept else 0
        source_len = max([end, *(state.source_mask.shape[1] for state in newcomers)])
        new_cross = [([to_numpy(k) for k in state.cross_keys], [to_numpy(v) for v in state.cross_values])
                     for state in newcomers]
        template = self._cross_keys[0] if self._cross_keys else new_cross[0][0][0]
        layers = len(self._cross_keys) if self._cross_keys else len(new_cross[0][0])
        heads, head_dim = template.shape[1], template.shape[3]
        cache_dtype = self._keys[0].dtype if self._keys else self.runtime.cache_dtype

        def gather(old: np.ndarray | None, new: list[np.ndarray], length: int, start: int,
                   dtype: np.dtype) -> np.ndarray:
            """(rows, h, length, d): kept rows' columns start..start+length, then each `new`."""
            out = np.zeros((rows, heads, length, head_dim), dtype=dtype)
            if kept and old is not None:
                part = old[:, :, start:start + length]  # (B, h, <= length, d)
                if part.shape[2] == length:  # straight into place ("clip": no buffered copy)
                    np.take(part, keep, axis=0, out=out[:kept], mode="clip")
                else:
                    out[:kept, :, : part.shape[2]] = part[keep]
            row = kept
            for array in new:
                out[row:row + array.shape[0], :, : array.shape[2]] = array
                row += array.shape[0]
            return out

        old_keys: list[np.ndarray | None] = list(self._cross_keys) if kept else [None] * layers
        old_values: list[np.ndarray | None] = list(self._cross_values) if kept else [None] * layers
        self._cross_keys = [gather(old_keys[i], [c[0][i] for c in new_cross], source_len, 0, template.dtype)
                            for i in range(layers)]
        self._cross_values = [gather(old_values[i], [c[1][i] for c in new_cross], source_len, 0, template.dtype)
                              for i in range(layers)]
        past_keys: list[np.ndarray | None] = list(self._keys) if self._keys else [None] * layers
        past_values: list[np.ndarray | None] = list(self._values) if self._values else [None] * layers
        self._keys = [gather(k if kept else None, [], past, first, cache_dtype) for k in past_keys]
        self._values = [gather(v if kept else None, [], past, first, cache_dtype) for v in past_values]
        source_mask = np.zeros((rows, source_len), dtype=bool)
        target_mask = np.zeros((rows, past), dtype=bool)
        if kept:
            source_mask[:kept, :end] = self._source_mask[keep, :end]
            target_mask[:kept] = self._target_mask[keep, first:]
        row = kept
        for state in newcomers:
            source_mask[row:row + state.source_mask.shape[0], : state.source_mask.shape[1]] = state.source_mask
            row += state.source_mask.shape[0]
        self._source_mask, self._target_mask = source_mask, target_mask
        self._positions = np.concatenate([self._positions[keep], np.zeros(count, dtype=np.int64)])
        self._last = np.concatenate([self._last[keep], np.full(count, self.runtime.decoder_start_id, dtype=np.int64)])
