"""Continuous batching over the decoder step graph: each row decodes in its own slot.

The in-flight batch contract of `service.batching.in_flight` (`concatenate` rows between steps,
`generate_token` returns the rows that stopped, `filter`), as `RunningBatch` implements it, but
on the runtime's step graph (`runtime.step`, `export.step_graph`) instead of the merged
decoder. Each row's keys/values stay in its slot of fixed buffers (row b: columns
0..its length-1); the graph attends over each row's own length and writes the new column in
place. So a newcomer joins without a copy of the batch and without its cache being padded to
the oldest row's, and a step costs what its rows' own lengths cost. The batcher's join age
limit (`max_join_age`) exists for the padded cache and does not apply here (`pads_to_oldest`).

The live rows stay dense in slots 0..n-1: when rows finish, the last live rows move into their
holes (a copy of those rows' own columns). Slots grow by doubling, cache columns and the cross
keys/values' source width to the next multiple of 32 (one copy of the live rows each time);
they shrink again when at most a quarter of the slots, columns or source width is in use, unless
the buffers hold at most `keep_bytes` (a few MiB by default): shrinking buffers that small saves
little memory, and at low concurrency the next row would grow them again, a copy per request. Spare
columns cost no compute (the graph reads each row's own length) and spare source width only a
masked stretch of cross-attention, far less than the copy that resizing costs; so the arrays
are kept generous and a batch whose lengths come and go does not resize at every join and
departure. Newcomers' cross keys/values are padded to the batch's source width; the padding is
masked, as in `RunningBatch`.

Where the slot buffers live: `HostSlots` (numpy, on the CPU) or `DeviceSlots` (OrtValues on the
runtime's device, written by tiny graphs there: `service.runtime.device_slots`), chosen by
`slots_on_device` (a runtime with IO binding on a device other than the CPU), or as asked
(`on_device`). The positions, next tokens and source mask stay on the host either way: they are
a few bytes per row, and the step takes them from there.

A vocabulary shortlist (`service.runtime.shortlist`), when the runtime has one and the slots are
on the host: each row's candidates (its source pieces' candidates in the table) are counted in
as it joins and out as it leaves, and a step of at most `shortlist_rows` live slots whose
shortlist holds at most `shortlist_share` of the vocabulary computes only the logits of the
batch's shortlist (the counted ids and the table's `always`, kept sorted and recomputed only
after a join or a departure); the step's argmax maps back to a token id through it. The
projection's columns for a shortlist are gathered once (`Shortlist.columns`) and kept while it
stays. The rule follows the cost: an int8 product over gathered columns (not prepacked, as the
whole projection is) pays at a few rows and a short list, and a full batch's shortlist changes
at nearly every step (bench/results/shortlist/served). A step with the batch's `scores`, with a
beam-search row, or with a live row that has a forced prefix, asks for its scores or samples its
tokens, computes the whole vocabulary: those need the probabilities of every token (and the
prefix's tokens may lie outside the shortlist). Device slots always compute the whole vocabulary.

Beam-search rows decode in the running batch too: a row of beam k takes k slots, one per beam
(its cross keys/values written k times), and after each step its `BeamRow` (the rules of
`service.generation.search`) picks the next beams from the log-probabilities of those k slots;
a beam whose parent is another slot of the row takes a copy of that slot's cache. The row
leaves, all k slots at once, when it closes. Greedy rows step beside it: a beam request holds
k rows of the batch for its length, and never pauses the others.

The same caveat as `RunningBatch`: with int8 graphs a row's activations are quantized with the
whole batch's scale, so its tokens may depend on its neighbours.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, cast

import numpy as np
import onnxruntime as ort

from service.batching.in_flight import (
    Member,
    Owner,
    advance,
    choose,
    encode_newcomers,
    newcomer_order,
)
from service.core.settings import SHORTLIST_SHARE
from service.generation.hooks import RowHooks
from service.generation.sampling import Sampling
from service.generation.search import BeamRow, GenerationResult, beam_candidates, log_softmax
from service.runtime.device_slots import (
    DeviceSlots,
    slot_graphs,
    step_dtypes,
    step_element_types,
)
from service.runtime.lone_slots import LoneSlots
from service.runtime.protocol import Runtime
from service.runtime.shortlist import Shortlist, ShortlistCounts
from service.runtime.step_buffers import HostSlots, cross_scales
from service.runtime.tensors import Tensor

PADDING_SLACK = 1.25  # host slots: newcomers encoded together while rows x longest <= this x their tokens
QUANTUM = 32  # cache columns and source width grow to the next multiple of this, not by doubling
KEEP_BYTES = 8 << 20  # slot buffers of at most this many bytes are not shrunk


def _doubled(size: int, needed: int) -> int:
    """`size` doubled until it holds `needed`."""
    size = max(size, 1)
    while size < needed:
        size *= 2
    return size


def _rounded(needed: int, quantum: int) -> int:
    """Cache columns (or source width) for `needed` positions: the next multiple of `quantum`.
    Every slot gets the longest row's columns, so doubling would give every row up to twice the
    cache one long row needs; a few more copies as that row grows cost less."""
    return -(-needed // quantum) * quantum


@dataclass(eq=False)
class BeamGroup(Generic[Owner]):
    """A beam-search row of the batch: its owner and its `BeamRow`, over k slots."""

    owner: Owner
    search: BeamRow
    slots: list[int] = field(default_factory=list)  # the slot of each beam, kept as slots move


@dataclass(eq=False)
class BeamSlot(Generic[Owner]):
    """The slot of beam `beam` (0..k-1) of a beam-search row."""

    group: BeamGroup[Owner]
    beam: int

    @property
    def owner(self) -> Owner:
        return self.group.owner


def _first(row: Member[Owner] | BeamSlot[Owner]) -> bool:
    """Whether a slot is its row's first: a greedy row's, or beam 0 of a beam-search row."""
    return not isinstance(row, BeamSlot) or row.beam == 0


def _age(row: Member[Owner] | BeamSlot[Owner]) -> int:
    """Decoder steps a slot's row has run."""
    return len(row.tokens) if isinstance(row, Member) else row.group.search.steps


class Slots(Protocol):
    """What `SlotBatch` asks of its slot buffers (`HostSlots`, `DeviceSlots`)."""

    @property
    def rows(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def write(self, row: int, cross: Sequence[Tensor]) -> None: ...
    def move_rows(self, sources: np.ndarray, targets: np.ndarray, columns: int, cross: bool = True) -> None: ...
    def resized(self, rows: int, capacity: int, width: int, kept_rows: int, kept_columns: int) -> Slots: ...
    def step(self, session: ort.InferenceSession, input_ids: np.ndarray, positions: np.ndarray,
             source_mask: np.ndarray) -> np.ndarray: ...


def slots_on_device(runtime: Runtime) -> bool:
    """Whether a batch of `runtime` keeps its slots on the device: when the runtime keeps its
    tensors on a device other than the CPU (IO binding). On the CPU numpy buffers are that
    memory already, and cheaper to index."""
    return bool(getattr(runtime, "io_binding", False)) and getattr(runtime, "device", "cpu") != "cpu"


def _device_slots(runtime: Runtime, rows: int, capacity: int) -> DeviceSlots:
    """Empty `DeviceSlots` on the runtime's device (its provider's tiny graphs), of its step
    graph's cache and cross types."""
    assert runtime.step is not None
    device = getattr(runtime, "device", "cpu")
    graphs = slot_graphs(runtime.provider, device, int(getattr(runtime, "device_id", 0)))
    cache_type, cross_type = step_element_types(runtime.step)
    if cross_scales(runtime.step) is not None:
        raise ValueError("a step graph with an int8 cache runs with host slots only (its newcomers are "
                         "quantized as the host writes them)")
    return DeviceSlots(graphs, runtime.n_decoder_layers, rows, runtime.n_heads, capacity, runtime.head_dim,
                       cache_type=cache_type, cross_type=cross_type)


class SlotBatch(Generic[Owner]):
    """The rows decoding together on the step graph; `add` rows, call `step` until it is empty."""

    pads_to_oldest = False  # a newcomer's cache is its own: joins cost the same at any age
    takes_beams = True  # beam-search rows join too, one slot per beam

    def __init__(self, runtime: Runtime, padding_slack: float | None = None, scores: bool = True,
                 rows: int = 8, capacity: int = QUANTUM, quantum: int = QUANTUM,
                 on_device: bool | None = None, shortlist_rows: int = 0,
                 shortlist_share: float = SHORTLIST_SHARE, keep_bytes: int = KEEP_BYTES) -> None:
        if runtime.step is None:
            raise ValueError("the runtime has no step graph (decoder_step.onnx): use RunningBatch")
        self.runtime = runtime
        self.scores = scores  # results carry their summed log-probability (else None)
        if on_device is None:
            on_device = slots_on_device(runtime)
        # newcomers are encoded in groups of similar length; on a device, all together (an encoder
        # call costs its launches there, not its padding)
        self.padding_slack = padding_slack if padding_slack is not None else (math.inf if on_device else PADDING_SLACK)
        self._initial = (rows, capacity)
        self.quantum = quantum  # columns and source width grow to multiples of this
        self.keep_bytes = keep_bytes  # slot buffers this small are never shrunk
        self._members: list[Member[Owner] | BeamSlot[Owner]] = []  # live rows: slot i holds self._members[i]
        # the beam-search rows among them (each in k slots), in the order they joined
        self._beams: dict[BeamGroup[Owner], None] = {}
        # the runtime's lone slot (`service.runtime.lone_slots`), for a greedy row alone, with device slots
        self._lone: LoneSlots | None = getattr(runtime, "lone", None) if on_device else None
        self._holding = False  # whether this batch holds the lone slot (`_enter`)
        self._slots: Slots = (_device_slots(runtime, rows, capacity) if on_device else
                              HostSlots(runtime.n_decoder_layers, rows, runtime.n_heads, capacity, runtime.head_dim,
                                        0, *step_dtypes(runtime.step), cross_scales(runtime.step)))
        self._source_mask = np.zeros((rows, 0), dtype=bool)  # (slots, S) True on real source tokens
        self._positions = np.zeros(rows, dtype=np.int64)  # (slots,) each row's cached length
        self._last = np.zeros(rows, dtype=np.int64)  # (slots,) each row's next input token
        # the runtime's shortlist (with `shortlist_rows` and host slots): each live row's candidates, in slot order
        found: Shortlist | None = getattr(runtime, "shortlist", None) if shortlist_rows > 0 and not on_device else None
        self._shortlist = found
        self.shortlist_rows = shortlist_rows  # the most live slots a step computes the shortlist for
        self.shortlist_share = shortlist_share  # the largest share of the vocabulary it computes
        self._counts = ShortlistCounts(found.table) if found is not None else None
        self._candidates: list[np.ndarray] = []
        # the shortlist the projection columns were made for (`ShortlistCounts.vocab`, the same
        # array until a row joins or leaves) and the columns
        self._columns: tuple[np.ndarray | None, Mapping[str, np.ndarray]] = (None, {})

    def __len__(self) -> int:
        """Slots still decoding (a beam-search row holds one per beam)."""
        return len(self._members)

    @property
    def on_device(self) -> bool:
        """Whether the slot buffers live on the runtime's device (`DeviceSlots`), not in host
        memory (`HostSlots`)."""
        return isinstance(self._slots, DeviceSlots)

    @property
    def shortlisted(self) -> bool:
        """Whether steps may compute the runtime's vocabulary shortlist only."""
        return self._shortlist is not None

    @property
    def slots(self) -> int:
        """Rows the buffers hold."""
        return self._slots.rows

    @property
    def capacity(self) -> int:
        """Cache columns per slot."""
        return self._slots.capacity

    @property
    def cache_bytes(self) -> int:
        """Bytes of the slot buffers (cache and cross keys/values, every slot's whole capacity
        and source width), on the host or the device."""
        return self._slots.nbytes

    @property
    def source_len(self) -> int:
        """The source width of the cross keys/values."""
        return int(self._source_mask.shape[1])

    @property
    def owners(self) -> list[Owner]:
        """The owner of each live row, in slot order (a beam-search row's at its beam 0)."""
        return [member.owner for member in self._members if _first(member)]

    @property
    def oldest_age(self) -> int:
        """Decoder steps the oldest live row has run (0 when empty)."""
        return max((_age(m) for m in list(self._members)), default=0)

    def concatenate(
        self,
        sources: Sequence[list[int]],
        owners: Sequence[Owner],
        max_new_tokens: Sequence[int],
        hooks: Sequence[RowHooks | None] | None = None,
        beam_sizes: Sequence[int] | None = None,
    ) -> None:
        """Encode `sources` (ids ending with EOS) and put them in the next free slots; a source
        of beam size k (`beam_sizes`, 1 each by default) takes k slots and is beam-searched."""
        if not sources:
            return
        beam_sizes = list(beam_sizes) if beam_sizes is not None else [1] * len(sources)
        if len(beam_sizes) != len(sources) or min(beam_sizes) < 1:
            raise ValueError("one beam size >= 1 per source")
        if not self._members:
            self._enter(lone=len(sources) == 1 and beam_sizes[0] == 1)
        # alone in the lone slot: its source encoded straight into the slot's cross buffers
        lone = self._lone if self._slots is self._lone and self._lone is not None and self._lone.encodes(sources) else None
        try:
            states, members = encode_newcomers(self.runtime, sources, owners, max_new_tokens, hooks,
                                               self.padding_slack, lone.encode if lone is not None else None)
        except BaseException:
            if not self._members:
                self._release_lone()
            raise
        order = newcomer_order(sources)  # the members' order (`encode_newcomers`)
        beams = [beam_sizes[i] for i in order]
        live = len(self._members)
        rows = live + sum(beams)
        width = max(state.source_mask.shape[1] for state in states)
        if self._slots is self._lone and rows > 1:  # leaving the lone slot: sized for the rows, as if it grew
            used = int(self._positions[0]) + 1 if live else 0
            own = int(self._source_mask[0].sum()) if live else 0  # the lone row's source length
            self._resize(_doubled(self._initial[0], rows), max(self._initial[1], _rounded(used, self.quantum)),
                         _rounded(max(width, own), self.quantum))
        elif rows > self.slots or width > self.source_len:
            self._resize(_doubled(self.slots, rows), self.capacity, max(_rounded(width, self.quantum), self.source_len))
        row, first = live, 0
        for state in states:  # a group encoded together: (count, w) sources
            count = state.source_mask.shape[0]
            if any(k > 1 for k in beams[first:first + count]):  # each beam of a row in its own slot
                state = state.select(np.repeat(np.arange(count), beams[first:first + count]))
            first += count
            count, w = state.source_mask.shape
            self._slots.write(row, [t for pair in zip(state.cross_keys, state.cross_values, strict=True) for t in pair])
            self._source_mask[row:row + count] = False
            self._source_mask[row:row + count, :w] = state.source_mask
            row += count
        self._positions[live:rows] = 0  # the slot's old columns are never read: the graph reads 0..position
        self._last[live:rows] = self.runtime.decoder_start_id
        for member, k in zip(members, beams, strict=True):
            if k == 1:
                self._members.append(member)
                continue
            group = BeamGroup(member.owner, BeamRow(k, self.runtime.eos_id, member.max_new_tokens,
                                                    hooks=member.hooks, track=member.token_scores is not None),
                              list(range(len(self._members), len(self._members) + k)))
            self._members += [BeamSlot(group, beam) for beam in range(k)]
            self._beams[group] = None
        if self._shortlist is not None and self._counts is not None:
            table = self._shortlist.table
            for i, k in zip(order, beams, strict=True):
                candidates = table.row_candidates(sources[i])
                for _ in range(k):
                    self._counts.join(candidates)
                    self._candidates.append(candidates)

    def generate_token(self) -> list[tuple[Owner, GenerationResult]]:
        """One decoder step for every row; returns the rows that finished (they have left)."""
        live = len(self._members)
        if not live:
            return []
        needed = int(self._positions[:live].max()) + 1  # the columns this step writes up to
        if needed > self.capacity:
            self._resize(self.slots, _rounded(needed, self.quantum), self.source_len)
        assert self.runtime.step is not None
        vocab = self.step_vocab()
        if vocab is None:
            logits = self._slots.step(self.runtime.step, self._last[:live, None], self._positions[:live, None],
                                      self._source_mask[:live])  # (n, V)
        else:
            assert self._shortlist is not None
            if self._columns[0] is not vocab:  # a new shortlist: its projection columns, made once
                self._columns = (vocab, self._shortlist.columns(vocab))
            logits = cast(HostSlots, self._slots).step(self._shortlist.session, self._last[:live, None],
                                                       self._positions[:live, None], self._source_mask[:live],
                                                       self._columns[1])  # (n, V')
        # the greedy rows (None: a beam's slot, chosen by its `BeamRow` below)
        greedy: Sequence[Member[Owner] | None] = (
            cast(list[Member[Owner]], self._members) if not self._beams
            else [m if isinstance(m, Member) else None for m in self._members])
        best, chosen = choose(greedy, logits, self.scores)  # (n,) each
        if vocab is not None:
            best = vocab[best]
        finished = advance(greedy, best, chosen, self.runtime.eos_id, self.scores)
        results = [result for _, result in finished]
        leaving = [i for i, _ in finished]
        if self._beams:
            closed, closed_results = self._advance_beams(logits, best)
            leaving += closed
            results += closed_results
        self._positions[:live] += 1
        self._last[:live] = best
        if leaving:
            self._remove(sorted(leaving))
        return results

    def _enter(self, lone: bool) -> None:
        """The slot buffers of an empty batch for its next rows: the runtime's lone slot for one
        greedy row (`lone`) when there is one and no other batch holds it, else the batch's own
        device slots (made again at the initial size when the lone slot was in use)."""
        if self._lone is None:
            return
        if lone and (self._holding or self._lone.take()):
            self._holding = True
            if self._slots is not self._lone:
                self._slots = self._lone
                self._reset(1, self._lone.width)
            return
        self._release_lone()
        if self._slots is self._lone:
            rows, capacity = self._initial
            self._slots = _device_slots(self.runtime, rows, capacity)
            self._reset(rows, 0)

    def _release_lone(self) -> None:
        """Give the lone slot back if this batch holds it."""
        if self._holding:
            assert self._lone is not None
            self._lone.give_back()
            self._holding = False

    def _reset(self, rows: int, width: int) -> None:
        """The host arrays of an empty batch, for `rows` slots and source width `width`."""
        self._source_mask = np.zeros((rows, width), dtype=bool)
        self._positions = np.zeros(rows, dtype=np.int64)
        self._last = np.zeros(rows, dtype=np.int64)

    def _advance_beams(self, logits: np.ndarray,
                       best: np.ndarray) -> tuple[list[int], list[tuple[Owner, GenerationResult]]]:
        """Each beam-search row's step (`BeamRow.advance`) from its slots' rows of the (n, V)
        `logits`: its next tokens into `best`, each beam's cache copied from its parent's slot
        where that is another slot; returns the slots of the rows that closed (all of each
        row's) and those rows' results."""
        index = np.asarray([i for group in self._beams for i in group.slots], dtype=np.int64)
        log_probs = log_softmax(logits[index])  # (sum of k, V)
        closed: list[int] = []
        results: list[tuple[Owner, GenerationResult]] = []
        sources: list[int] = []
        targets: list[int] = []
        first = 0
        for group in self._beams:
            group_slots = group.slots
            search, k = group.search, len(group_slots)
            own = log_probs[first:first + k]  # (k, V)
            first += k
            top_scores, top_index = beam_candidates(search.scores[None], own, k)
            chosen = search.advance(own, top_scores[0], top_index[0])
            if chosen is None:
                closed += group_slots
                results.append((group.owner, search.result()))
                continue
            parents, tokens = chosen
            best[group_slots] = tokens
            for slot, parent in zip(group_slots, parents, strict=True):
                if group_slots[parent] != slot:
                    sources.append(group_slots[parent])
                    targets.append(slot)
        if sources:  # every cache column written so far (positions 0..position); one source per row
            source_index = np.asarray(sources, dtype=np.int64)
            self._slots.move_rows(source_index, np.asarray(targets, dtype=np.int64),
                                  int(self._positions[source_index].max()) + 1, cross=False)
        return closed, results

    def step_vocab(self) -> np.ndarray | None:
        """The ids this step computes: the batch's shortlist, or None (the whole vocabulary)
        without a shortlist, over `shortlist_rows` live slots or `shortlist_share` of the
        vocabulary, with the batch's `scores`, while a beam-search row decodes, or while a live
        row has a forced prefix, asks for its scores or draws its tokens (a sampler)."""
        if self._counts is None or self.scores or self._beams or len(self._members) > self.shortlist_rows:
            return None
        if any(member.prefix or member.token_scores is not None
               or (member.hooks is not None and member.hooks.sampler is not None)
               for member in self._members if isinstance(member, Member)):
            return None
        vocab = self._counts.vocab
        return vocab if len(vocab) <= self.shortlist_share * self._counts.table.vocab_size else None

    def filter(self, owners: Collection[Owner]) -> list[Owner]:
        """Keep only the rows of `owners`; the others leave at once (the last live rows move
        into their slots); returns the owners that left."""
        gone = [i for i, m in enumerate(self._members) if m.owner not in owners]
        left = [self._members[i].owner for i in gone if _first(self._members[i])]
        if gone:
            self._remove(gone)
        return left

    def _remove(self, finished: list[int]) -> None:
        """Take the finished slots (ascending) out: the last live rows move into the holes."""
        live = len(self._members)
        left = live - len(finished)
        gone = set(finished)
        holes = np.asarray([i for i in finished if i < left], dtype=np.int64)
        movers = np.asarray([i for i in range(left, live) if i not in gone], dtype=np.int64)
        if self._counts is not None:
            for i in finished:
                self._counts.leave(self._candidates[i])
        for i in finished:
            if isinstance(member := self._members[i], BeamSlot):
                self._beams.pop(member.group, None)
        if holes.size:
            self._slots.move_rows(movers, holes, int(self._positions[movers].max()))
            for array in (self._source_mask, self._positions, self._last):
                array[holes] = array[movers]
            for hole, mover in zip(holes.tolist(), movers.tolist(), strict=True):
                member = self._members[hole] = self._members[mover]
                if isinstance(member, BeamSlot):
                    member.group.slots[member.beam] = hole
                if self._counts is not None:
                    self._candidates[hole] = self._candidates[mover]
        del self._members[left:]
        del self._candidates[left:]
        if not self._members:  # another batch may take the lone slot now
            self._release_lone()
        self._shrink()

    def _shrink(self) -> None:
        """Smaller arrays when at most a quarter of the slots, the columns or the source width
        is in use (never below the initial sizes), unless they hold at most `keep_bytes` or are
        the lone slot (left when rows join, or for the batch's own slots when it is empty)."""
        if self._slots.nbytes <= self.keep_bytes or self._slots is self._lone:  # the lone slot's size is fixed
            return
        live = len(self._members)
        rows, capacity = self._initial
        used_columns = int(self._positions[:live].max()) + 1 if live else 0
        used_source = np.flatnonzero(self._source_mask[:live].any(axis=0))
        width = int(used_source[-1]) + 1 if used_source.size else 0
        new_rows = self.slots if 4 * live > self.slots else max(rows, _doubled(rows, 2 * live))
        new_capacity = self.capacity if 4 * used_columns > self.capacity else max(capacity, _rounded(used_columns, self.quantum))
        new_width = self.source_len if 4 * width > self.source_len else _rounded(width, self.quantum)
        if (new_rows, new_capacity, new_width) != (self.slots, self.capacity, self.source_len):
            self._resize(new_rows, new_capacity, new_width)

    def _resize(self, rows: int, capacity: int, width: int) -> None:
        """New arrays of `rows` slots, `capacity` columns and source width `width`, with the
        live rows copied (one copy)."""
        live = len(self._members)
        columns = min(capacity, int(self._positions[:live].max())) if live else 0
        old = self._slots
        self._slots = old.resized(rows, capacity, width, live, columns)
        if old is self._lone and self._slots is not old:  # the row moved out of the lone slot
            self._release_lone()
        kept = min(width, self.source_len)
        mask = np.zeros((rows, width), dtype=bool)
        mask[:live, :kept] = self._source_mask[:live, :kept]
        self._source_mask = mask
        for name in ("_positions", "_last"):
            new_vector = np.zeros(rows, dtype=np.int64)
            new_vector[:live] = getattr(self, name)[:live]
            setattr(self, name, new_vector)


def generate_running(runtime: Runtime, sources: Iterable[tuple[Owner, list[int]]], rows: int = 64,
                     max_new_tokens: int | None = None, shortlist_rows: int = 0,
                     join_at: int = 1, sampling: Sampling | None = None) -> Iterator[tuple[Owner, GenerationResult]]:
    """Greedy decoding of `sources` ((owner, ids ending with EOS) pairs) in-process through one
    `SlotBatch` of at most `rows` slots, as the server's running batch decodes them, without a
    server: before each step, once at least `join_at` slots are free (or none is taken), the
    next sources take the free slots (encoded together, `concatenate`). Yields each
    (owner, result) as its row finishes. With `sampling`, each row draws its tokens instead
    (`service.generation.sampling`), the source of owner i (an int, then) drawing as row i: its
    draws do not depend on which batch takes it, or when.

    `sources` is read lazily, as slots free up, so several threads may share one iterator (read
    under a lock) and each run its own batch: replicas dividing a workload as it goes, as
    CTranslate2's `inter_threads` divide `translate_batch`'s batches."""
    if rows < 1 or join_at < 1:
        raise ValueError(f"rows and join_at must be >= 1, got {rows}, {join_at}")
    limit = max_new_tokens or runtime.max_target_len
    batch: SlotBatch[Owner] = SlotBatch(runtime, scores=False, rows=rows, shortlist_rows=shortlist_rows)
    feed = iter(sources)
    exhausted = False
    while True:
        free = rows - len(batch)
        if not exhausted and (free >= join_at or not len(batch)):
            newcomers = list(itertools.islice(feed, free))
            exhausted = len(newcomers) < free
            if newcomers:
                hooks = None if sampling is None else [RowHooks(sampler=sampling.sampler(cast(int, owner)))
                                                       for owner, _ in newcomers]
                batch.concatenate([source for _, source in newcomers], [owner for owner, _ in newcomers],
                                  [limit] * len(newcomers), hooks)
        if not len(batch):
            return
        yield from batch.generate_token()
