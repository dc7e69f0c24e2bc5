"""Quality of a checkpoint on a split: sacreBLEU BLEU/chrF (translation), ROUGE-1/2/L and the
lead baseline (summarization), written as a JSON report."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from model.decoding import beam_search, pad_batch
from model.run_config import read_split
from model.tokenizer import Tokenizer
from model.transformer import Transformer

log = logging.getLogger(__name__)


def generate_texts(
    model: Transformer,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    beam_size: int = 1,
    max_new_tokens: int | None = None,
    batch_size: int = 64,
    progress: bool = False,
) -> list[str]:
    """Generate an output for each text, batching inputs of similar length."""
    config = model.config
    max_new_tokens = max_new_tokens or config.max_target_len
    encoded = [ids[: config.max_source_len - 1] + [config.eos_id] for ids in tokenizer.encode_batch(list(texts))]
    order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
    outputs: list[str] = [""] * len(texts)
    for start in tqdm(range(0, len(order), batch_size), disable=not progress, unit="batch"):
        rows = order[start : start + batch_size]
        source = pad_batch([encoded[i] for i in rows], config.pad_id)
        for row, generation in zip(rows, beam_search(model, source, beam_size, max_new_tokens), strict=True):
            outputs[row] = tokenizer.decode(generation.tokens)
    return outputs


def translation_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Corpus BLEU and chrF with sacreBLEU's defaults."""
    import sacrebleu

    return {
        "bleu": round(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score, 2),
        "chrf": round(sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score, 2),
    }


def rouge_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1 (x100) with stemming, as the `rouge-score` package computes it."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for hypothesis, reference in zip(hypotheses, references, strict=True):
        for name, score in scorer.score(reference, hypothesis).items():
            totals[name] += score.fmeasure
    return {name: round(100 * total / max(len(references), 1), 2) for name, total in totals.items()}


def lead_baseline(source: str, reference: str) -> str:
    """The first sentence of the description, cut to the reference synopsis' word count."""
    first = re.split(r"(?<=[.!?])\s+", source.strip(), maxsplit=1)[0]
    return " ".join(first.split()[: len(reference.split())])


def evaluate(
    model: Transformer,
    tokenizer: Tokenizer,
    task: str,
    data_dir: str | Path,
    split: str = "test",
    beam_sizes: Sequence[int] = (1, 4),
    limit: int | None = None,
    batch_size: int = 64,
) -> dict[str, Any]:
    """Score greedy and beam outputs on the first `limit` rows of a split."""
    sources, references = read_split(data_dir, split)
    if limit:
        sources, references = sources[:limit], references[:limit]
    score = translation_scores if task.startswith("translate") else rouge_scores
    report: dict[str, Any] = {"task": task, "split": split, "rows": len(sources), "results": {}}
    for beam in beam_sizes:
        started = time.perf_counter()
        hypotheses = generate_texts(model, tokenizer, sources, beam, batch_size=batch_size, progress=True)
        name = "greedy" if beam == 1 else f"beam{beam}"
        report["results"][name] = dict(score(hypotheses, references), seconds=round(time.perf_counter() - started, 1))
        report.setdefault("examples", [
            {"source": s, "reference": r, "output": h} for s, r, h in zip(sources[:5], references[:5], hypotheses[:5])
        ])
        log.info("%s %s: %s", task, name, report["results"][name])
    if not task.startswith("translate"):
        report["results"]["lead_baseline"] = rouge_scores([lead_baseline(s, r) for s, r in zip(sources, references)], references)
    return report


def write_report(report: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")

