"""Beam search through the running batch against request-level beam search: the same test
sources, the same served variant, BLEU and chrF of both and the share of identical outputs.

Request-level: `service.generation.search.generate` over batches of `--batch` sources of similar
length (what `--no-continuous-batching` serves). Running batch: one `SlotBatch` that takes the
sources in arrival order, `--group` at a time while fewer than `--rows` slots decode (a row of
beam k holding k slots), as the service's continuous batching does. With int8 graphs a row's
activations are quantized with its whole batch's scale, so the two may differ by that; with
fp32 they give the same tokens. Results: `<out>/beam_quality.json` and `.md`.

    python -m bench.beam_quality --model models/translate-en-it --data-dir data --out bench/results/beam_quality
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench import machine
from bench.workload import read_lines


def running_batch(runtime: Any, sources: list[list[int]], beam: int, rows: int, group: int) -> list[list[int]]:
    """Each source's tokens through one `SlotBatch`: `group` newcomers join, in order, while
    fewer than `rows` slots decode."""
    from service.batching.slot_batch import SlotBatch

    batch: SlotBatch[int] = SlotBatch(runtime, scores=False)
    outputs: list[list[int]] = [[] for _ in sources]
    index = 0
    while index < len(sources) or len(batch):
        if index < len(sources) and len(batch) + group * beam <= max(rows, group * beam):
            newcomers = sources[index:index + group]
            batch.concatenate(newcomers, list(range(index, index + len(newcomers))),
                              [runtime.max_target_len] * len(newcomers), beam_sizes=[beam] * len(newcomers))
            index += len(newcomers)
        for owner, result in batch.generate_token():
            outputs[owner] = result.tokens
    return outputs


def request_level(runtime: Any, sources: list[list[int]], beam: int, size: int) -> list[list[int]]:
    """Each source's tokens from `generate` over batches of `size` sources of similar length."""
    from service.generation.search import generate

    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    outputs: list[list[int]] = [[] for _ in sources]
    for start in range(0, len(order), size):
        chosen = order[start:start + size]
        for i, result in zip(chosen, generate(runtime, [sources[i] for i in chosen], beam, runtime.max_target_len),
                             strict=True):
            outputs[i] = result.tokens
    return outputs


def markdown(results: dict[str, Any]) -> str:
    config = results["config"]
    lines = ["# Beam search through the running batch and in request-level batches", "",
             f"Command: `{results['command']}`", "",
             (f"Machine: {results['machine'].get('cpu')}, {results['machine'].get('cpu_count')} cores. "
              f"{config['sentences']} test sentences, beam {config['beam']}, variant {config['variant']}; "
              f"request-level batches of {config['batch']}, the running batch up to {config['rows']} slots "
              f"with newcomers joining {config['group']} at a time."), "",
             "| decoding | BLEU | chrF | seconds |", "|---|---|---|---|"]
    for name, run in results["runs"].items():
        lines.append(f"| {name} | {run['bleu']} | {run['chrf']} | {run['seconds']:.1f} |")
    lines += ["", f"Identical outputs: {results['identical']:.3f}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/beam_quality"))
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--variant", default=None, help="the repository's variant (default: the served one)")
    parser.add_argument("--batch", type=int, default=16, help="sources per request-level batch")
    parser.add_argument("--rows", type=int, default=64, help="slots of the running batch")
    parser.add_argument("--group", type=int, default=4, help="sources joining at a time")
    args = parser.parse_args(argv)
    from model.evaluation import translation_scores
    from service.runtime import ModelRuntime

    runtime = ModelRuntime.load(args.model, providers=["CPUExecutionProvider"], threads=1, variant=args.variant)
    data = args.data_dir / args.model.name
    texts = read_lines(data / "test.src", args.sentences)
    references = read_lines(data / "test.tgt", args.sentences)
    limit = runtime.max_source_len - 1
    sources = [ids[:limit] + [runtime.eos_id] for ids in runtime.tokenizer.encode_batch(texts)]
    runs: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name, decode in (("request-level batches", lambda: request_level(runtime, sources, args.beam, args.batch)),
                         ("running batch", lambda: running_batch(runtime, sources, args.beam, args.rows, args.group))):
        started = time.perf_counter()
        outputs[name] = decode()
        seconds = time.perf_counter() - started
        hypotheses = [runtime.tokenizer.decode(tokens) for tokens in outputs[name]]
        runs[name] = {**translation_scores(hypotheses, references), "seconds": round(seconds, 2)}
    first, second = outputs.values()
    results = {
        "command": shlex.join(["python", "-m", "bench.beam_quality", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine.describe(),
        "config": {"sentences": len(sources), "beam": args.beam, "variant": runtime.variant, "batch": args.batch,
                   "rows": args.rows, "group": args.group},
        "runs": runs,
        "identical": sum(a == b for a, b in zip(first, second, strict=True)) / len(sources),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "beam_quality.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (args.out / "beam_quality.md").write_text(markdown(results), encoding="utf-8")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
