"""Numpy I/O vs IO binding for the generation loop on one execution provider (CPU by default).

    python -m bench.io_binding --model-dir models/translate-en-it --rows 32 --reps 10

Loads the model twice (`io_binding=False` / `True`), takes `--rows` sentences of mixed length
from `--source` (seeded sample), and times `service.generation.search.generate` (encoder + decoder
steps) on the whole batch, alternating the two runtimes rep by rep so that load from other
processes hits both alike. Checks that both give the same tokens. Writes (merges) the result
for this model and provider into `--out`, keyed "<model>/<provider>/beam<k>/rows<n>/threads<t>".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import onnxruntime as ort

from service.generation.search import generate
from service.runtime import CPU, ModelRuntime

DEFAULT_OUT = Path("bench/results/io_binding_cpu.json")


def _sources(runtime: ModelRuntime, path: Path, rows: int, seed: int) -> list[list[int]]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    picked = random.Random(seed).sample(lines, min(rows, len(lines)))
    limit = runtime.max_source_len - 1
    return [runtime.tokenizer.encode(text)[:limit] + [runtime.eos_id] for text in picked]


def _summary(seconds: list[float]) -> dict[str, float]:
    return {"median_s": round(statistics.median(seconds), 5), "mean_s": round(statistics.fmean(seconds), 5),
            "min_s": round(min(seconds), 5), "max_s": round(max(seconds), 5)}


def measure(model_dir: Path, source: Path, rows: int, reps: int, beam_size: int, max_new_tokens: int,
            threads: int, provider: str, seed: int) -> dict[str, Any]:
    runtimes = {mode: ModelRuntime.load(model_dir, [provider], threads=threads, variant="fp32", io_binding=mode)
                for mode in (False, True)}
    sources = _sources(runtimes[False], source, rows, seed)
    max_new = max_new_tokens or runtimes[False].max_target_len
    outputs = {}
    for mode, runtime in runtimes.items():  # warm-up, and the tokens to compare
        runtime.warmup()
        outputs[mode] = generate(runtime, sources, beam_size, max_new)
    same = [(g.tokens, g.finish_reason) for g in outputs[False]] == [(g.tokens, g.finish_reason) for g in outputs[True]]
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(reps):
        for mode in ((False, True) if rep % 2 == 0 else (True, False)):
            started = time.perf_counter()
            generate(runtimes[mode], sources, beam_size, max_new)
            times[mode].append(time.perf_counter() - started)
    numpy_io, bound = _summary(times[False]), _summary(times[True])
    lengths = [len(s) for s in sources]
    generated = sum(len(g.tokens) + (g.finish_reason == "eos") for g in outputs[False])
    return {
        "model": runtimes[False].name, "provider": provider, "variant": "fp32", "threads": threads,
        "rows": len(sources), "beam_size": beam_size, "max_new_tokens": max_new, "reps": reps,
        "source_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
        "generated_tokens": generated,
        "decoder_steps": max(len(g.tokens) + (g.finish_reason == "eos") for g in outputs[False]),
        "same_tokens": same,
        "numpy_io": {**numpy_io, "all_s": [round(t, 5) for t in times[False]]},
        "io_binding": {**bound, "all_s": [round(t, 5) for t in times[True]]},
        "io_binding_speedup_median": round(numpy_io["median_s"] / bound["median_s"], 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.io_binding", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--source", type=Path, default=Path("data/translate-en-it/test.src"),
                        help="one source sentence a line")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--beam-size", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=0, help="0: the model's max_target_len")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads; 0 = onnxruntime's")
    parser.add_argument("--provider", default=CPU)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    result = measure(args.model_dir, args.source, args.rows, args.reps, args.beam_size, args.max_new_tokens,
                     args.threads, args.provider, args.seed)
    result["environment"] = {"onnxruntime": ort.__version__, "cpu_count": os.cpu_count(),
                             "load_average_1m": round(os.getloadavg()[0], 2), "machine": platform.machine()}
    results = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {}
    key = f"{result['model']}/{result['provider']}/beam{result['beam_size']}/rows{result['rows']}/threads{result['threads']}"
    results[key] = result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k not in ("numpy_io", "io_binding")}, indent=None))
    print(f"numpy I/O median {result['numpy_io']['median_s']:.4f}s, IO binding median "
          f"{result['io_binding']['median_s']:.4f}s -> written to {args.out}")


if __name__ == "__main__":
    main()
