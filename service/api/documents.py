"""Long documents on translation models: a text cut into rows the model can take, and their
outputs joined back into the text's own layout.

The rule (`split`):

- A text that is one sentence on one line and fits the model's window (`limit` source tokens,
  EOS excepted) is one row, exactly as sent; its output is the model's output alone.
- Any other text is cut at every line break, and each line into sentences (`sentencex`, with
  the model's source language). A sentence longer than the window is cut between words into
  chunks that fit; a single word longer than the window is refused (`InvalidInput`).
- Each piece is one row. The whitespace around and between the pieces (spaces, line breaks,
  blank lines, indentation) and the list mark a piece starts with (`*`, `-`, `+` or `•`, then
  a space) are kept verbatim and put back around their outputs, so the joined output has the
  text's paragraphs, lines and lists. A piece that has no tokens is kept verbatim too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sentencex

from service.core.errors import InvalidInput

_LINE_BREAK = re.compile(r"([\n\r\u2028\u2029])")  # one character: no backtracking
_WORD = re.compile(r"\S+")
_LIST_MARK = re.compile(r"[*+\-\u2022]\s+")


@dataclass(frozen=True)
class Document:
    """A text as rows: `separators[0] + out[0] + separators[1] + ... + out[-1] + separators[-1]`
    is its output, for `out` the outputs of `segments`."""

    segments: list[str]
    separators: list[str]  # one more than the segments
    ids: list[list[int]]  # the token ids of each segment (without EOS)

    @property
    def rows(self) -> int:
        return len(self.segments)

    def join(self, outputs: Sequence[str]) -> str:
        """The output of the text: the outputs of its segments within its separators."""
        assert len(outputs) == len(self.segments)
        parts = [self.separators[0]]
        for output, separator in zip(outputs, self.separators[1:], strict=True):
            parts += [output, separator]
        return "".join(parts)


def whole(text: str, ids: list[int]) -> Document:
    """The text as one row, as sent."""
    return Document([text], ["", ""], [ids])


def split(text: str, tokenizer: Any, limit: int, language: str, where: str) -> Document:
    """The rows of `text` by the module's rule, each of at most `limit` tokens."""
    separators, pieces = _pieces(text, language)
    if len(pieces) <= 1:
        [ids] = tokenizer.encode_batch([text])
        if not ids:
            raise InvalidInput(f"{where}: the text has no tokens")
        if len(ids) <= limit:
            return whole(text, ids)
    segments: list[str] = []
    kept: list[str] = [separators[0]]
    all_ids: list[list[int]] = []
    for piece, ids, after in zip(pieces, tokenizer.encode_batch(pieces), separators[1:],
                                 strict=True):
        if not ids:  # nothing for the model: kept as it is
            kept[-1] += piece + after
            continue
        chunks = [(0, len(piece), ids)] if len(ids) <= limit else _chunks(piece, tokenizer,
                                                                            limit, where)
        for i, (begin, end, chunk_ids) in enumerate(chunks):
            segments.append(piece[begin:end])
            all_ids.append(chunk_ids)
            kept.append(after if i == len(chunks) - 1 else piece[end:chunks[i + 1][0]])
    if not segments:
        raise InvalidInput(f"{where}: the text has no tokens")
    return Document(segments, kept, all_ids)


def _pieces(text: str, language: str) -> tuple[list[str], list[str]]:
    """The sentences of each line of `text` without their surrounding whitespace and list
    marks, and what is around and between them (one more than the sentences)."""
    separators: list[str] = [""]
    pieces: list[str] = []
    parts = _LINE_BREAK.split(text)  # line, break, line, ..., line
    for i, part in enumerate(parts):
        if i % 2:
            separators[-1] += part
            continue
        sentences = list(sentencex.segment(language, part))
        if "".join(sentences) != part:  # the segmenter must only cut; else the line is one piece
            sentences = [part]
        for sentence in sentences:
            core = sentence.strip()
            if not core:
                separators[-1] += sentence
                continue
            start = sentence.index(core)
            mark = _LIST_MARK.match(core)
            if mark is not None:
                start, core = start + mark.end(), core[mark.end():]
            separators[-1] += sentence[:start]
            pieces.append(core)
            separators.append(sentence[start + len(core):])
    return separators, pieces


def _chunks(sentence: str, tokenizer: Any, limit: int, where: str) -> list[tuple[int, int, list[int]]]:
    """`sentence` cut between words into chunks of at most `limit` tokens, each as long as the
    words allow: their (start, end) in `sentence` and their token ids."""
    words = [(m.start(), m.end()) for m in _WORD.finditer(sentence)]
    counts = [len(ids) for ids in tokenizer.encode_batch([sentence[a:b] for a, b in words])]
    if max(counts) > limit:
        raise InvalidInput(f"{where}: a word of {max(counts)} tokens; at most {limit} allowed "
                           "(a longer sentence is cut between words)")
    groups: list[tuple[int, int]] = []  # word index ranges
    first, total = 0, 0
    for i, count in enumerate(counts):
        if i > first and total + count > limit:
            groups.append((first, i))
            first, total = i, 0
        total += count
    groups.append((first, len(words)))
    chunks: list[tuple[int, int, list[int]]] = []
    while groups:
        first, last = groups.pop(0)
        start, end = words[first][0], words[last - 1][1]
        [ids] = tokenizer.encode_batch([sentence[start:end]])
        if len(ids) > limit and last - first > 1:  # the words' counts did not add up: halve it
            middle = (first + last) // 2
            groups[:0] = [(first, middle), (middle, last)]
            continue
        if len(ids) > limit:
            raise InvalidInput(f"{where}: a word of {len(ids)} tokens; at most {limit} allowed "
                               "(a longer sentence is cut between words)")
        chunks.append((start, end, ids))
    return chunks
