"""Word alignments from cross-attention: which source words each target word translates. Numpy only.

Input: the cross-attention of one teacher-forced pass, `[layer][head][row][source position]`,
with the conventions of `service.generation.attention_maps`: row i reads `<s>` + target[:i]
and predicts target piece i (the row after the last piece predicts `</s>`); the source
positions are the source's pieces, then `</s>`. Pieces come with their character spans.

Output: hard links between whitespace-separated words (`Word`: the text between two runs of
whitespace, punctuation included), as 0-based `(source word, target word)` pairs, written in
Pharaoh format as `i-j`.

A `Method` says how:
1. the rows and positions: the chosen layers' and heads' weights, averaged; a target piece
   takes the row that predicts it, or with `shift` the row that reads it (the next one, where
   the decoder has the piece as input);
2. words: a target word's row is the mean of its pieces' rows, and a source word's column the
   sum of its pieces' columns (a row stays a distribution over source words plus `</s>`, whose
   share is the weight left for "no source word"); pieces that cover no word (a lone `▁`,
   `</s>`) belong to none;
3. the links (`extraction`): `t2s` each target word to its heaviest source word; `s2t` each
   source word to its heaviest target word; `intersect` the links both give; `union` either;
   `grow-diag` the intersection grown by union links next to (diagonals included) a link, that
   cover a word not yet covered, until none is added; `threshold` every cell of weight
   `threshold` or more.

`DEFAULT` is the method the service uses, `BASELINE` the naive one it is measured against
(last layer, heads averaged, argmax of the predicting row): the measurement and the command
that repeats it are in bench/results/alignment/.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Extraction = Literal["t2s", "s2t", "intersect", "union", "grow-diag", "threshold"]
EXTRACTIONS: tuple[Extraction, ...] = ("t2s", "s2t", "intersect", "union", "grow-diag", "threshold")
_WORD = re.compile(r"\S+")
_NEIGHBOURS = ((-1, 0), (1, 0), (0, -1), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1))


@dataclass(frozen=True)
class Word:
    """A whitespace-separated word of a text and its characters `text[start:end]`."""

    text: str
    start: int
    end: int


@dataclass(frozen=True)
class Method:
    """How links are drawn from cross-attention (see the module's docstring).

    `layers` and `heads` index the decoder's layers (negative from the last) and heads; None
    takes them all.
    """

    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    shift: bool = False
    extraction: Extraction = "t2s"
    threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.extraction not in EXTRACTIONS:
            raise ValueError(f"unknown extraction {self.extraction!r}; one of {EXTRACTIONS}")
        if self.extraction == "threshold" and not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"a threshold in (0, 1] is needed, got {self.threshold}")
        for name in ("layers", "heads"):
            values = getattr(self, name)
            if values is not None and not values:
                raise ValueError(f"`{name}` is empty; None takes them all")

    @property
    def name(self) -> str:
        """A short label: layers, heads, shift and extraction, e.g. `L0+1/h*/shift/t2s`."""
        layers = "+".join(map(str, self.layers)) if self.layers is not None else "*"
        heads = "+".join(map(str, self.heads)) if self.heads is not None else "*"
        links = f"threshold{self.threshold:g}" if self.extraction == "threshold" else self.extraction
        return f"L{layers}/h{heads}/{'shift' if self.shift else 'predict'}/{links}"


BASELINE = Method(layers=(-1,), shift=False, extraction="t2s")
# The best F1 on the dev half of tests/fixtures/alignment (bench/alignment.py): the last two
# layers, heads averaged, predicting rows, each source word to its heaviest target word.
DEFAULT = Method(layers=(-2, -1), shift=False, extraction="s2t")


@dataclass(frozen=True)
class Alignment:
    """Links `(source word, target word)`, sorted, between the words of both texts."""

    links: list[tuple[int, int]]
    source_words: list[Word]
    target_words: list[Word]

    @property
    def pharaoh(self) -> str:
        """The links as `i-j` pairs separated by spaces (empty without links)."""
        return pharaoh(self.links)


def pharaoh(links: Sequence[tuple[int, int]]) -> str:
    """`(i, j)` pairs as Pharaoh text: `"0-0 1-2"`."""
    return " ".join(f"{i}-{j}" for i, j in links)


def parse_pharaoh(line: str) -> set[tuple[int, int]]:
    """The `(i, j)` pairs of one Pharaoh line (`i-j` or possible links `i?j` count alike)."""
    links = set()
    for token in line.split():
        i, sep, j = token.replace("?", "-").partition("-")
        if not sep or not i.isdigit() or not j.isdigit():
            raise ValueError(f"not a Pharaoh link: {token!r}")
        links.add((int(i), int(j)))
    return links


def words(text: str) -> list[Word]:
    """The whitespace-separated words of `text` with their character spans."""
    return [Word(m.group(), m.start(), m.end()) for m in _WORD.finditer(text)]


def word_of_pieces(spans: Sequence[tuple[int, int]], text_words: Sequence[Word]) -> list[int | None]:
    """For each piece span `(start, end)`, the index of the first word it overlaps, or None
    (a piece of whitespace only, or a special piece spanning nothing)."""
    result: list[int | None] = []
    w = 0
    for start, end in spans:
        while w < len(text_words) and text_words[w].end <= start:
            w += 1
        # Pieces come in text order, so the word is at or after the previous piece's word.
        found = next((k for k in range(w, len(text_words))
                      if text_words[k].start < end and start < text_words[k].end), None)
        result.append(found)
    return result


def piece_rows(cross: np.ndarray, n_target_pieces: int, method: Method) -> np.ndarray:
    """(L, H, rows, S) cross-attention -> (target pieces, S): the method's layers and heads
    averaged, one row per target piece (its predicting row, or with `shift` its reading row)."""
    if cross.ndim != 4:
        raise ValueError(f"cross-attention must be (layers, heads, rows, source), got {cross.shape}")
    layers = list(method.layers) if method.layers is not None else list(range(cross.shape[0]))
    heads = list(method.heads) if method.heads is not None else list(range(cross.shape[1]))
    offset = 1 if method.shift else 0
    if cross.shape[2] < n_target_pieces + offset:
        raise ValueError(f"{cross.shape[2]} rows for {n_target_pieces} target pieces "
                         f"({'shifted: one more row needed' if method.shift else 'unshifted'})")
    chosen = cross[layers][:, heads].astype(np.float64).mean(axis=(0, 1))  # (rows, S)
    return chosen[offset: offset + n_target_pieces]


def word_matrix(rows: np.ndarray, target_word: Sequence[int | None], source_word: Sequence[int | None],
                n_target_words: int, n_source_words: int) -> np.ndarray:
    """(target pieces, source positions) weights -> (target words, source words): a target
    word's row is the mean of its pieces' rows, a source word's column the sum of its pieces'
    columns; positions past `source_word` (`</s>`) and pieces of no word are left out."""
    if rows.shape[0] != len(target_word) or rows.shape[1] < len(source_word):
        raise ValueError(f"weights {rows.shape} for {len(target_word)} target and "
                         f"{len(source_word)} source pieces")
    to_source = np.zeros((rows.shape[1], n_source_words))  # source position -> its word
    for position, word in enumerate(source_word):
        if word is not None:
            to_source[position, word] = 1.0
    summed = rows @ to_source  # (target pieces, source words)
    matrix = np.zeros((n_target_words, n_source_words))
    counts = np.zeros(n_target_words)
    for piece, word in enumerate(target_word):
        if word is not None:
            matrix[word] += summed[piece]
            counts[word] += 1
    return matrix / np.maximum(counts, 1)[:, None]


def extract(matrix: np.ndarray, method: Method) -> set[tuple[int, int]]:
    """Links `(source word, target word)` of a (target words, source words) weight matrix."""
    n_target, n_source = matrix.shape
    if n_target == 0 or n_source == 0:
        return set()
    if method.extraction == "threshold":
        return {(int(i), int(j)) for j, i in zip(*np.nonzero(matrix >= method.threshold), strict=True)}
    t2s = {(int(matrix[j].argmax()), j) for j in range(n_target)}
    s2t = {(i, int(matrix[:, i].argmax())) for i in range(n_source)}
    if method.extraction == "t2s":
        return t2s
    if method.extraction == "s2t":
        return s2t
    if method.extraction == "intersect":
        return t2s & s2t
    if method.extraction == "union":
        return t2s | s2t
    return _grow_diag(t2s & s2t, t2s | s2t)


def _grow_diag(links: set[tuple[int, int]], union: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Add union links next to a link (diagonals too) that cover a word not yet covered."""
    grown = set(links)
    added = True
    while added:
        added = False
        for i, j in sorted(grown):
            for di, dj in _NEIGHBOURS:
                candidate = (i + di, j + dj)
                if candidate in grown or candidate not in union:
                    continue
                if all(s != candidate[0] for s, _ in grown) or all(t != candidate[1] for _, t in grown):
                    grown.add(candidate)
                    added = True
    return grown


def align(cross: np.ndarray, source_text: str, source_spans: Sequence[tuple[int, int]],
          target_text: str, target_spans: Sequence[tuple[int, int]],
          method: Method = DEFAULT) -> Alignment:
    """Word alignment of `target_text` to `source_text` from one pass's cross-attention.

    `cross` is (layers, heads, rows, source positions); `source_spans` and `target_spans` are
    the character spans of the source's and target's pieces (without `</s>`), in order. Rows:
    at least one per target piece, one more with a shifting method.
    """
    source_words, target_words = words(source_text), words(target_text)
    source_word = word_of_pieces(source_spans, source_words)
    target_word = word_of_pieces(target_spans, target_words)
    rows = piece_rows(np.asarray(cross), len(target_spans), method)
    matrix = word_matrix(rows, target_word, source_word, len(target_words), len(source_words))
    return Alignment(sorted(extract(matrix, method)), source_words, target_words)


@dataclass(frozen=True)
class Scores:
    """Alignment quality against sure gold links: precision, recall, F1, AER and the counts.

    With sure links only (possible = sure), AER = 1 - 2|A∩S| / (|A| + |S|) = 1 - F1.
    """

    precision: float
    recall: float
    f1: float
    aer: float
    predicted: int
    gold: int
    correct: int


def score(predicted: Sequence[set[tuple[int, int]]], sure: Sequence[set[tuple[int, int]]],
          possible: Sequence[set[tuple[int, int]]] | None = None) -> Scores:
    """Micro-averaged scores of predicted links against gold links, sentence by sentence.

    Precision counts predicted links among the possible ones (the sure ones when none are
    given), recall sure links predicted; AER = 1 - (|A∩S| + |A∩P|) / (|A| + |S|).
    """
    if len(predicted) != len(sure) or (possible is not None and len(possible) != len(sure)):
        raise ValueError("one set of links per sentence in each list")
    allowed = [p | s for p, s in zip(possible, sure, strict=True)] if possible is not None else sure
    n_predicted = sum(len(a) for a in predicted)
    n_sure = sum(len(s) for s in sure)
    hit_sure = sum(len(a & s) for a, s in zip(predicted, sure, strict=True))
    hit_possible = sum(len(a & p) for a, p in zip(predicted, allowed, strict=True))
    precision = hit_possible / n_predicted if n_predicted else 0.0
    recall = hit_sure / n_sure if n_sure else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    total = n_predicted + n_sure
    aer = 1.0 - (hit_sure + hit_possible) / total if total else 0.0
    return Scores(precision, recall, f1, aer, n_predicted, n_sure, hit_sure)
