"""A vocabulary shortlist for the decoder step (CTranslate2's vocabulary map): per batch, the
target pieces that can follow its rows' sources plus the most frequent ones, so that the output
projection computes only those columns.

Three files, all written by `export.shortlist`:
- the table (`.npz`): `candidates` (vocab, K) int ids, the K target pieces most associated with
  each source piece in the training pairs; `always` (N',) the most frequent target pieces and
  the special ids (EOS, UNK), part of every shortlist;
- the projection graph (`shortlist_projection.onnx`): from `vocab` (V',) int64, the sorted ids
  whose logits a step computes, the output projection's columns for them (its int8 weight,
  scales and zero points), one output per constant;
- the step graph with the shortlist (`decoder_step_shortlist.onnx`): `export.step_graph`'s
  inputs plus those columns, as inputs of the same names; `logits` (B, V') holds the ids of
  `vocab` in its order (`vocab[argmax]` is the token). The columns are made once per new
  shortlist (`Shortlist.columns`), not at every step.

A row's candidates are the union of its source pieces' rows of `candidates`; a batch's shortlist
is the union of its rows' candidates and `always` (`ShortlistCounts` keeps it as rows join and
leave). Torch- and onnx-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.runtime.providers import session_options

TABLE_KEYS = ("candidates", "always")


@dataclass(frozen=True)
class ShortlistTable:
    """Each source piece's candidate target pieces (vocab, K) and the pieces every shortlist
    holds (`always`)."""

    candidates: np.ndarray  # (vocab, K) target ids, the most associated first
    always: np.ndarray  # (N',) sorted target ids: the most frequent pieces and the specials

    @property
    def vocab_size(self) -> int:
        return int(self.candidates.shape[0])

    @classmethod
    def load(cls, path: str | Path) -> ShortlistTable:
        """Read a table written by `export.shortlist.save_table`."""
        with np.load(Path(path)) as data:
            missing = [key for key in TABLE_KEYS if key not in data]
            if missing:
                raise ValueError(f"{path}: not a shortlist table (missing {missing})")
            candidates = data["candidates"].astype(np.int64)
            always = np.unique(data["always"].astype(np.int64))
        if candidates.ndim != 2 or candidates.min(initial=0) < 0 or candidates.max(initial=0) >= len(candidates):
            raise ValueError(f"{path}: candidates must be (vocab, K) ids below vocab")
        return cls(candidates, always)

    def row_candidates(self, source: Sequence[int]) -> np.ndarray:
        """The sorted, distinct candidate ids of one source (its pieces' candidates)."""
        ids = np.asarray(source, dtype=np.int64)
        return np.unique(self.candidates[ids[(ids >= 0) & (ids < self.vocab_size)]])

    def shortlist(self, sources: Sequence[Sequence[int]]) -> np.ndarray:
        """The sorted shortlist of a batch of sources: their candidates and `always`."""
        parts = [self.row_candidates(source) for source in sources]
        return np.unique(np.concatenate([self.always, *parts]))


@dataclass
class Shortlist:
    """The step graph that reads the projection's columns as inputs (its session), the graph
    that makes them from a shortlist (`projection`) and the table that fills it; both graphs are
    made from the runtime's own step graph (`export.shortlist.shortlist_graphs`), so the logits
    they compute are those columns of the runtime's."""

    session: ort.InferenceSession
    projection: ort.InferenceSession
    table: ShortlistTable

    @classmethod
    def load(cls, graph: str | Path, projection: str | Path, table: str | Path, threads: int = 0,
             spinning: bool = True, memory_arena: bool = True) -> Shortlist:
        """CPU sessions of the shortlist's step and projection graphs (the options `ModelRuntime`
        gives its int8 sessions: all graph optimizations, constant folding of the dequantized
        weights) and its table; the step graph must read every column the projection makes."""
        options = session_options(threads, spinning, memory_arena, fold_dequantize=True)
        session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        made = ort.InferenceSession(str(projection), session_options(1, False, memory_arena),
                                    providers=["CPUExecutionProvider"])
        if [i.name for i in made.get_inputs()] != ["vocab"]:
            raise ValueError(f"{projection}: the projection graph must take `vocab` only (export.shortlist makes it)")
        missing = {o.name for o in made.get_outputs()} - {i.name for i in session.get_inputs()}
        if missing or not made.get_outputs():
            raise ValueError(f"{graph}: the step graph does not read the projection's columns {sorted(missing)}")
        return cls(session, made, ShortlistTable.load(table))

    def columns(self, vocab: np.ndarray) -> dict[str, np.ndarray]:
        """The step graph's column inputs for the sorted ids `vocab`, by input name."""
        names = [o.name for o in self.projection.get_outputs()]
        values = self.projection.run(names, {"vocab": np.ascontiguousarray(vocab, dtype=np.int64)})
        return {name: np.ascontiguousarray(value) for name, value in zip(names, values, strict=True)}


@dataclass
class ShortlistCounts:
    """A batch's shortlist as rows come and go: per vocabulary id, how many live rows have it
    as a candidate (+1 per candidate when a row joins, -1 when it leaves); the shortlist is the
    ids counted at least once and the table's `always`, recomputed only after a change."""

    table: ShortlistTable
    counts: np.ndarray = field(init=False)
    _always: np.ndarray = field(init=False)
    _vocab: np.ndarray | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.counts = np.zeros(self.table.vocab_size, dtype=np.int32)
        self._always = np.zeros(self.table.vocab_size, dtype=bool)
        self._always[self.table.always] = True

    def join(self, candidates: np.ndarray) -> None:
        """Count a row's (distinct) candidates in."""
        self.counts[candidates] += 1
        self._vocab = None

    def leave(self, candidates: np.ndarray) -> None:
        """Count a row's candidates out."""
        self.counts[candidates] -= 1
        self._vocab = None

    @property
    def vocab(self) -> np.ndarray:
        """The sorted ids the step computes: counted candidates and `always`."""
        if self._vocab is None:
            self._vocab = np.flatnonzero((self.counts > 0) | self._always).astype(np.int64)
        return self._vocab
