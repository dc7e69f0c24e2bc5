"""`attnserve generate`: a text file through a model in-process, one output line per input
line, without a server (the batch job of back-translation or of translating a corpus).

The rule, per line: a translation model's line is cut into the rows the server would cut it
into (`service.api.documents`: sentences, and chunks of an over-long sentence) and their outputs
joined back into its layout; another model's line is one row, cut to the model's window (the
server's `truncate`). A line without tokens is written as it is. Every row of the file then
decodes at once: greedy and sampled rows through running batches of `rows` slots fed shortest
first, newcomers joining a quarter of the slots at a time (`generate_running`), beam search in
request-level batches of `rows` sources of similar length; `replicas` threads share the rows
(one intra-op thread each by default: on a CPU, a batch per core is the fastest way). With
`sampling`, row i of the file (the rows of its lines in order) draws as row i of the seed
(`service.generation.sampling`): the same file, model and seed give the same outputs, whatever
the replicas.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from service.api import documents
from service.api.pipeline import TRANSLATE, source_language
from service.batching.slot_batch import generate_running
from service.core.errors import InvalidInput
from service.generation.sampling import Sampling
from service.generation.search import GenerationResult, generate
from service.runtime.protocol import Runtime

T = TypeVar("T")


class Shared(Iterator[T]):
    """An iterator several threads read from, one item at a time under a lock."""

    def __init__(self, items: Iterable[T]) -> None:
        self._items = iter(items)
        self._lock = threading.Lock()

    def __next__(self) -> T:
        with self._lock:
            return next(self._items)


def generate_lines(runtime: Runtime, lines: Sequence[str], beam_size: int = 1, max_new_tokens: int | None = None,
                   sampling: Sampling | None = None, rows: int = 64, replicas: int = 1,
                   first_row: int = 0) -> tuple[list[str], int]:
    """The output of each of `lines` by the module's rule, in order, and the rows they took;
    `first_row` is the number of their first row in the file (lines read a part at a time)."""
    if beam_size < 1 or rows < 1 or replicas < 1:
        raise ValueError(f"beam_size, rows and replicas must be >= 1, got {beam_size}, {rows}, {replicas}")
    if sampling is not None and beam_size > 1:
        raise ValueError("sampling draws one token per step: beam_size 1 only")
    window = runtime.max_source_len - 1  # room for EOS
    eos = runtime.tokenizer.eos_id
    layouts: list[documents.Document | None] = []
    sources: list[list[int]] = []
    for number, line in enumerate(lines, 1):
        layout = _layout(runtime, line, window, f"line {number}")
        layouts.append(layout)
        if layout is not None:
            sources += [[*ids, eos] for ids in layout.ids]
    outputs = _decode(runtime, sources, beam_size, max_new_tokens or runtime.max_target_len, sampling, rows,
                      replicas, first_row)
    texts = [runtime.tokenizer.decode(result.tokens) for result in outputs]
    found, start = [], 0
    for line, layout in zip(lines, layouts, strict=True):
        if layout is None:
            found.append(line)
            continue
        found.append(layout.join(texts[start:start + len(layout.ids)]))
        start += len(layout.ids)
    return found, len(sources)


def _layout(runtime: Runtime, line: str, window: int, where: str) -> documents.Document | None:
    """A line's rows and layout, or None for a line without tokens."""
    if runtime.task == TRANSLATE:
        try:
            return documents.split(line, runtime.tokenizer, window, source_language(runtime), where)
        except InvalidInput:
            if not runtime.tokenizer.encode(line):
                return None
            raise
    ids = runtime.tokenizer.encode(line)[:window]
    return documents.whole(line, ids) if ids else None


def _decode(runtime: Runtime, sources: list[list[int]], beam_size: int, limit: int, sampling: Sampling | None,
            rows: int, replicas: int, first_row: int) -> list[GenerationResult]:
    """Each source's result, in order, decoded by `replicas` threads (source i is row
    `first_row` + i of the file)."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: dict[int, GenerationResult] = {}
    lock = threading.Lock()
    if beam_size == 1:
        feed = Shared((first_row + i, sources[i]) for i in order)

        def replica() -> None:
            for row, result in generate_running(runtime, feed, rows, limit, join_at=max(1, rows // 4),
                                                sampling=sampling):
                with lock:
                    results[row - first_row] = result
    else:
        batches = Shared(order[start:start + rows] for start in range(0, len(order), rows))

        def replica() -> None:
            for batch in batches:
                generated = generate(runtime, [sources[i] for i in batch], beam_size, limit, greedy_scores=False)
                with lock:
                    results.update(zip(batch, generated, strict=True))
    with ThreadPoolExecutor(replicas) as pool:
        for future in [pool.submit(replica) for _ in range(replicas)]:
            future.result()
    return [results[i] for i in range(len(sources))]


def batched(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    """`lines` in lists of `size` (the last shorter): a file read a part at a time."""
    iterator = iter(lines)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk

