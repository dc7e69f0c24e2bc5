"""CTranslate2 on the same weights: `translate_batch` throughput over a grid of the settings its
users tune (replicas x threads, batch size and type), single-sentence latency, and agreement
(exact match) with our ONNX greedy outputs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.stats import RunStats, summarise

MAX_BATCH_SIZE = 64
# The batch settings of the grid: (batch_type, max_batch_size), in examples or in tokens.
BATCH_GRID = (("examples", 32), ("examples", 64), ("examples", 128),
              ("tokens", 1024), ("tokens", 2048), ("tokens", 4096))


@dataclass(frozen=True)
class Ct2Settings:
    """How one CTranslate2 run is configured: replicas (`inter_threads`), intra-op threads per
    replica (0 = CTranslate2's default), and how `translate_batch` cuts the input into batches."""

    inter_threads: int = 1
    intra_threads: int = 0
    max_batch_size: int = MAX_BATCH_SIZE
    batch_type: str = "examples"

    @property
    def key(self) -> str:
        return f"inter{self.inter_threads}_intra{self.intra_threads}_{self.batch_type}{self.max_batch_size}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def thread_grid(cores: int | None = None) -> list[tuple[int, int]]:
    """(inter_threads, intra_threads) pairs a user would try on `cores` cores: the default (one
    replica, CTranslate2's own thread count), one replica on every core, one single-threaded
    replica per core, and two replicas sharing the cores when there are at least four."""
    cores = cores or os.cpu_count() or 1
    pairs = [(1, 0), (1, cores), (cores, 1)]
    if cores >= 4:
        pairs.append((2, cores // 2))
    return list(dict.fromkeys(pairs))


def settings_grid(cores: int | None = None) -> list[Ct2Settings]:
    """Every thread pair of `thread_grid` with every batch setting of `BATCH_GRID`."""
    return [Ct2Settings(inter, intra, size, kind) for inter, intra in thread_grid(cores) for kind, size in BATCH_GRID]


def load_translator(ct2_dir: Path, compute_type: str, threads: int = 0, inter_threads: int = 1) -> Any:
    """A CPU `ctranslate2.Translator`: `inter_threads` replicas of `threads` intra-op threads each
    (0 = CTranslate2's default)."""
    import ctranslate2

    return ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=compute_type,
                                  inter_threads=inter_threads, intra_threads=threads)


def translate(translator: Any, pieces: Sequence[list[str]], beam_size: int, max_decoding_length: int,
              max_batch_size: int = MAX_BATCH_SIZE, batch_type: str = "examples",
              **options: Any) -> list[list[str]]:
    """Best hypothesis (pieces, without EOS) for each source given as pieces (ending with EOS).
    With several replicas, `translate_batch` runs its batches on them in parallel; `options` are
    `translate_batch`'s others (e.g. `sampling_topk`)."""
    results = translator.translate_batch(list(pieces), beam_size=beam_size, max_batch_size=max_batch_size,
                                         batch_type=batch_type, max_decoding_length=max_decoding_length, **options)
    return [r.hypotheses[0] for r in results]


def run_batch(translator: Any, pieces: Sequence[list[str]], beam_size: int, max_decoding_length: int,
              max_batch_size: int = MAX_BATCH_SIZE, batch_type: str = "examples",
              **options: Any) -> tuple[RunStats, list[list[str]]]:
    """One `translate_batch` call over the whole workload (`options`: `translate`'s); latency =
    the call's wall time."""
    started = time.perf_counter()
    outputs = translate(translator, pieces, beam_size, max_decoding_length, max_batch_size, batch_type, **options)
    elapsed = time.perf_counter() - started
    return summarise([elapsed] * len(outputs), sum(len(o) for o in outputs), elapsed), outputs


def int8_greedy(model_dir: Path, scratch: Path, pieces: Sequence[list[str]], max_decoding_length: int,
                settings: Ct2Settings, single: bool = False) -> Callable[[], RunStats]:
    """Our repository `model_dir` converted for CTranslate2 (under `scratch`) and loaded in int8
    at `settings`: a function that times one greedy `run_batch` over `pieces`, or with `single`
    one sentence per call (`run_single`)."""
    from bench import ctranslate2_converter

    translator = load_translator(ctranslate2_converter.convert(model_dir, scratch / "ctranslate2"), "int8",
                                 threads=settings.intra_threads, inter_threads=settings.inter_threads)

    def run() -> RunStats:
        if single:
            return run_single(translator, pieces, 1, max_decoding_length)
        return run_batch(translator, pieces, 1, max_decoding_length, settings.max_batch_size, settings.batch_type)[0]

    return run


def run_grid(ct2_dir: Path, compute_type: str, pieces: Sequence[list[str]], max_decoding_length: int,
             grid: Sequence[Ct2Settings], single: Sequence[list[str]] = ()) -> dict[str, Any]:
    """Greedy `translate_batch` throughput at every point of `grid` (one translator per thread
    pair), and with `single` sources the single-sentence latency of each thread pair.

    Returns `points` (each point's settings and stats), `best` (the highest sentences/s, with
    its settings), and with `single`, `single_points` and `best_single` (the lowest p50)."""
    points: list[dict[str, Any]] = []
    single_points: list[dict[str, Any]] = []
    pairs = list(dict.fromkeys((s.inter_threads, s.intra_threads) for s in grid))
    for inter, intra in pairs:
        translator = load_translator(ct2_dir, compute_type, intra, inter)
        for settings in (s for s in grid if (s.inter_threads, s.intra_threads) == (inter, intra)):
            stats, _ = run_batch(translator, pieces, 1, max_decoding_length, settings.max_batch_size,
                                 settings.batch_type)
            points.append({"settings": settings.to_dict(), **stats.to_dict()})
        if single:
            stats = run_single(translator, single, 1, max_decoding_length)
            single_points.append({"settings": Ct2Settings(inter, intra, 1).to_dict(), **stats.to_dict()})
        del translator
    result: dict[str, Any] = {"points": points, "best": max(points, key=lambda p: p["sentences_per_s"])}
    if single_points:
        result["single_points"] = single_points
        result["best_single"] = min(single_points, key=lambda p: p["latency_p50_s"])
    return result


def run_single(translator: Any, pieces: Sequence[list[str]], beam_size: int,
               max_decoding_length: int) -> RunStats:
    """One sentence per call, one after another: CT2's single-sentence latency."""
    latencies, tokens = [], 0
    started = time.perf_counter()
    for source in pieces:
        call_started = time.perf_counter()
        tokens += len(translate(translator, [source], beam_size, max_decoding_length, 1)[0])
        latencies.append(time.perf_counter() - call_started)
    return summarise(latencies, tokens, time.perf_counter() - started)


def agreement(ours: Sequence[Sequence[str]], theirs: Sequence[Sequence[str]]) -> float:
    """Fraction of sentences whose outputs are identical token for token."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} outputs vs {len(theirs)}")
    if not ours:
        return 0.0
    return sum(list(a) == list(b) for a, b in zip(ours, theirs, strict=True)) / len(ours)
