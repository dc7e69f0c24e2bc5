"""Quality of an exported variant through the serving path (onnxruntime + `service.generation.search`):
BLEU/chrF (translation) or ROUGE-1/2/L (summarization) of greedy outputs on test rows."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from model.evaluation import rouge_scores, translation_scores
from model.run_config import read_split
from service.generation.search import generate
from service.runtime import ModelRuntime

log = logging.getLogger(__name__)

MAX_DROP = 1.0  # a variant scoring more than this many points below fp32 on any metric is not servable
METRICS = {"translate": ("bleu", "chrf"), "summarize": ("rouge1", "rouge2", "rougeL")}


def measure_quality(
    runtime: ModelRuntime, data_dir: str | Path, rows: int, split: str = "test", batch_size: int = 32,
    progress: bool = False,
) -> dict[str, Any]:
    """Scores of greedy outputs on the first `rows` rows of `split`."""
    sources, references = read_split(data_dir, split)
    sources, references = sources[:rows], references[:rows]
    eos, keep = runtime.eos_id, runtime.max_source_len - 1
    encoded = [ids[:keep] + [eos] for ids in runtime.tokenizer.encode_batch(sources)]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    hypotheses = [""] * len(encoded)
    started = time.perf_counter()
    for start in tqdm(range(0, len(order), batch_size), disable=not progress, unit="batch",
                      desc=f"quality {runtime.variant}"):
        batch = order[start : start + batch_size]
        results = generate(runtime, [encoded[i] for i in batch], 1, runtime.max_target_len)
        for i, result in zip(batch, results, strict=True):
            hypotheses[i] = runtime.tokenizer.decode(result.tokens)
    score = translation_scores if runtime.task == "translate" else rouge_scores
    report: dict[str, Any] = dict(score(hypotheses, references))
    report.update(split=split, rows=len(sources), decoding="greedy", provider=runtime.provider,
                  seconds=round(time.perf_counter() - started, 1))
    log.info("%s %s quality: %s", runtime.name, runtime.variant, report)
    return report


def within_bound(task: str, reference: dict[str, Any], candidate: dict[str, Any]) -> bool:
    """True when no metric of `candidate` is more than `MAX_DROP` points below `reference`."""
    return all(candidate[m] >= reference[m] - MAX_DROP for m in METRICS[task])
