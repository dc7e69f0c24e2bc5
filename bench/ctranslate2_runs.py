"""CTranslate2 on the same weights: `translate_batch` throughput, single-sentence latency, and
agreement (exact match) with our ONNX greedy outputs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.stats import RunStats, summarise

MAX_BATCH_SIZE = 64


def load_translator(ct2_dir: Path, compute_type: str, threads: int = 0) -> Any:
    """A CPU `ctranslate2.Translator` (one replica; `threads` intra-op, 0 = CT2's default)."""
    import ctranslate2

    return ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=compute_type,
                                  inter_threads=1, intra_threads=threads)


def translate(translator: Any, pieces: Sequence[list[str]], beam_size: int, max_decoding_length: int,
              max_batch_size: int = MAX_BATCH_SIZE) -> list[list[str]]:
    """Best hypothesis (pieces, without EOS) for each source given as pieces (ending with EOS)."""
    results = translator.translate_batch(list(pieces), beam_size=beam_size, max_batch_size=max_batch_size,
                                         max_decoding_length=max_decoding_length)
    return [r.hypotheses[0] for r in results]


def run_batch(translator: Any, pieces: Sequence[list[str]], beam_size: int, max_decoding_length: int,
              max_batch_size: int = MAX_BATCH_SIZE) -> tuple[RunStats, list[list[str]]]:
    """One `translate_batch` call over the whole workload; latency = the call's wall time."""
    started = time.perf_counter()
    outputs = translate(translator, pieces, beam_size, max_decoding_length, max_batch_size)
    elapsed = time.perf_counter() - started
    return summarise([elapsed] * len(outputs), sum(len(o) for o in outputs), elapsed), outputs


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
