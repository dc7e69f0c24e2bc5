"""onnxruntime's weight-only int8 kernel (`MatMulNBits`, 8 bits, blocks of 32, int8 compute)
against the shipped int8 graphs (`DynamicQuantizeMatMul` / `MatMulIntegerToFloat`) and fp32.

    python -m bench.weight_only --model models/translate-en-it --data-dir data --out bench/results/weight-only

The fp32 encoder and step graph (their bfloat16 weights cast to float32 first) go through
`MatMulNBitsQuantizer` into a scratch folder; the three variants then decode the first
`--sentences` test sources, one thread each, in alternating turns: each sentence alone (p50
latency) and all of them through a running batch of `--rows` slots (sentences/s), and each
variant's lone outputs are compared with fp32's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine

GRAPHS = ("encoder", "decoder_step")


def fold_casts(model: Any) -> Any:
    """`model` with each Cast of an initializer replaced by a float32 initializer of the Cast's
    output (the fp32 graphs keep bfloat16 weights behind a Cast; the quantizer wants constants)."""
    from onnx import numpy_helper

    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    kept = []
    for node in model.graph.node:
        if node.op_type == "Cast" and node.input[0] in initializers:
            values = numpy_helper.to_array(initializers[node.input[0]]).astype(np.float32)
            model.graph.initializer.append(numpy_helper.from_array(values, node.output[0]))
        else:
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model


def quantize(model_dir: Path, out_dir: Path, block_size: int = 32) -> dict[str, Path]:
    """The fp32 encoder and step graph of `model_dir` with every constant MatMul as an 8-bit
    `MatMulNBits` (symmetric, `block_size`, accuracy level 4: int8 compute), in `out_dir`."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    paths = {}
    for name in GRAPHS:
        model = fold_casts(onnx.load(str(model_dir / f"{name}.onnx")))
        quantizer = MatMulNBitsQuantizer(model, bits=8, block_size=block_size, is_symmetric=True, accuracy_level=4)
        quantizer.process()
        paths[name] = out_dir / f"{name}.onnx"
        onnx.save(quantizer.model.model, str(paths[name]), save_as_external_data=True, location=f"{name}.bin")
    return paths


def time_variant(runtime: Any, sources: list[list[int]], alone: int, rows: int) -> tuple[dict[str, float], list[list[int]]]:
    """Each of the first `alone` sources decoded alone (p50 seconds), then every source through
    one running batch of `rows` slots (sentences/s); the lone outputs."""
    from service.batching.slot_batch import generate_running

    latencies, outputs = [], []
    for i, source in enumerate(sources[:alone]):
        started = time.perf_counter()
        outputs.append(next(iter(generate_running(runtime, [(i, source)], rows=1)))[1].tokens)
        latencies.append(time.perf_counter() - started)
    started = time.perf_counter()
    for _ in generate_running(runtime, list(enumerate(sources)), rows=rows):
        pass
    return {"alone_p50_s": statistics.median(latencies),
            "batch_sentences_per_s": len(sources) / (time.perf_counter() - started)}, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.weight_only", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--sentences", type=int, default=300)
    parser.add_argument("--alone", type=int, default=150, help="sentences also decoded alone")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import onnxruntime as ort

    from bench import workload as workload_module
    from bench.in_process import load_runtime
    from service.runtime.providers import session_options

    int8 = load_runtime(args.model, 1)
    fp32 = load_runtime(args.model, 1, variant="fp32")
    work = workload_module.load(args.data_dir, args.model.name, int8.task, int8.tokenizer, int8.max_source_len,
                                args.sentences)
    with tempfile.TemporaryDirectory(prefix="weight-only-") as scratch:
        paths = quantize(args.model, Path(scratch))
        options = session_options(1, True, True)
        sessions = {name: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                    for name, path in paths.items()}
        weight_only = dataclasses.replace(int8, encoder=sessions["encoder"], step=sessions["decoder_step"])
        variants = {"int8 (shipped)": int8, "weight-only int8 (MatMulNBits)": weight_only, "fp32": fp32}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        outputs: dict[str, list[list[int]]] = {}
        for turn in range(args.turns):
            for name in (list(variants) if turn % 2 == 0 else list(variants)[::-1]):
                timing, outputs[name] = time_variant(variants[name], work.source_ids, args.alone, args.rows)
                runs[name].append(timing)
    result: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "bench.weight_only", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine.describe(), "sentences": len(work.source_ids), "alone": args.alone, "rows": args.rows,
        "runs": runs,
        "identical_to_fp32_alone": {name: sum(a == b for a, b in zip(out, outputs["fp32"], strict=True)) / len(out)
                                    for name, out in outputs.items()},
    }
    lines = ["# Weight-only int8 (MatMulNBits) against the shipped int8 graphs", "", f"Command: `{result['command']}`", "",
             f"One thread each, {args.turns} alternating turns; medians over the turns.", "",
             f"| variant | p50 alone (ms) | running batch of {args.rows} (sentences/s) | lone outputs identical to fp32 |",
             "|---|---|---|---|"]
    for name, timings in runs.items():
        alone = statistics.median(t["alone_p50_s"] for t in timings) * 1000
        batch = statistics.median(t["batch_sentences_per_s"] for t in timings)
        lines.append(f"| {name} | {alone:.1f} | {batch:.1f} | {result['identical_to_fp32_alone'][name]:.3f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weight_only.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (args.out / "weight_only.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
