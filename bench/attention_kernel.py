"""What a decoder step's attention kernel of our own would save: onnxruntime's
`GroupQueryAttention` (the step graph's int8 cache, one thread) against the same attention as
plain C loops over rows and heads (`bench/attention_loop.c`, compiled here with the machine's C
compiler), on the same inputs.

    python -m bench.attention_kernel --out bench/results/attention-kernel

For each shape (rows, each row's length, the cache's columns) both kernels start from the same
caches: their outputs' largest difference and whether they wrote the same cache columns are
checked first (the new key and value quantized into the same cache column), then the two are timed in alternating rounds (`--rounds` of `--calls` calls each,
the order swapped every round); the report gives each one's median microseconds per call, per
row and head, and their ratio. The loop is compiled with `-O3 -march=native -ffast-math`
(`FLAGS`; linked without the last one's start-up code, which would set flush-to-zero for the
process), as a kernel built on its host would be; it is a measurement, not a part of the server.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine
from bench.step_variants import ATTENTION_SCALE, HEAD_DIM, HEADS, attention_inputs, attention_runner

SOURCE = Path(__file__).with_name("attention_loop.c")
# compiled so; linked without -ffast-math, whose start-up code would set flush-to-zero for the
# whole process that loads the library
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC")
# (rows, length, capacity): a lone row and a full batch of 64, at a short self-attention cache,
# a test sentence's mean source (24 pieces), and longer sources
SHAPES = ((1, 8, 64), (1, 24, 64), (64, 8, 64), (64, 16, 64), (64, 24, 64), (64, 40, 64), (64, 64, 128))
GQA = "GroupQueryAttention (onnxruntime)"
LOOP = "plain C loops (bench/attention_loop.c)"


def compiler() -> str | None:
    """The C compiler: $CC, else `cc` on the path (None without one)."""
    return os.environ.get("CC") or shutil.which("cc")


def compile_loop(directory: Path) -> ctypes.CDLL:
    """`attention_loop.c` built into a shared library in `directory` and loaded."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler: set CC or install one (e.g. gcc)")
    library, objects = directory / "attention_loop.so", directory / "attention_loop.o"
    subprocess.run([cc, *FLAGS, "-c", str(SOURCE), "-o", str(objects)], check=True)
    subprocess.run([cc, "-shared", str(objects), "-o", str(library), "-lm"], check=True)
    loaded = ctypes.CDLL(str(library))
    pointer, integer, real = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    loaded.attention_step.argtypes = [pointer] * 6 + [integer] * 4 + [real, real, pointer, pointer]
    loaded.attention_step.restype = None
    return loaded


def loop_runner(library: ctypes.CDLL, inputs: dict[str, np.ndarray]
                ) -> tuple[Callable[[], None], Callable[[], np.ndarray], Callable[[], tuple[np.ndarray, np.ndarray]]]:
    """`attention_step` on a copy of `inputs`: a call, its (rows, 1, 256) output, and its caches."""
    rows, _, capacity, _ = inputs["pk"].shape
    q, k, v = (np.ascontiguousarray(inputs[name]) for name in ("q", "k", "v"))
    keys, values = inputs["pk"].copy(), inputs["pv"].copy()
    past = np.ascontiguousarray(inputs["lengths"], dtype=np.int32)
    out = np.empty_like(q)
    scratch = np.empty(capacity, dtype=np.float32)
    arguments = (q.ctypes.data, k.ctypes.data, v.ctypes.data, keys.ctypes.data, values.ctypes.data, past.ctypes.data,
                 rows, HEADS, capacity, HEAD_DIM, ATTENTION_SCALE, ATTENTION_SCALE, out.ctypes.data,
                 scratch.ctypes.data)
    return (lambda: library.attention_step(*arguments)), (lambda: out), (lambda: (keys, values))


def compare(library: ctypes.CDLL, rows: int, length: int, capacity: int, calls: int, rounds: int,
            seed: int = 0) -> dict[str, Any]:
    """Both kernels at one shape: agreement after one call each from the same caches, then
    microseconds per call in alternating rounds."""
    inputs = attention_inputs("int8", rows, length, capacity, seed)
    gqa_call, gqa_output, gqa_caches = attention_runner("int8", inputs)
    loop_call, loop_output, loop_caches = loop_runner(library, inputs)
    gqa_call()
    loop_call()
    same_cache = all(np.array_equal(a, b) for a, b in zip(gqa_caches(), loop_caches(), strict=True))
    difference = float(np.abs(gqa_output().reshape(rows, -1) - loop_output().reshape(rows, -1)).max())
    times: dict[str, list[float]] = {GQA: [], LOOP: []}
    runners = {GQA: gqa_call, LOOP: loop_call}
    for _ in range(max(calls // 5, 5)):
        gqa_call()
        loop_call()
    for turn in range(rounds):
        for name in (list(runners) if turn % 2 == 0 else list(runners)[::-1]):
            started = time.perf_counter()
            for _ in range(calls):
                runners[name]()
            times[name].append((time.perf_counter() - started) / calls * 1e6)
    us = {name: statistics.median(values) for name, values in times.items()}
    return {"rows": rows, "length": length, "capacity": capacity, "max_difference": difference,
            "same_cache": same_cache, "us": us,
            "us_per_row_head": {name: value / (rows * HEADS) for name, value in us.items()},
            "ratio": us[GQA] / us[LOOP], "rounds_us": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention_kernel", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=[f"{r}x{n}x{c}" for r, n, c in SHAPES],
                        help="rows x length x capacity, e.g. 64x24x64")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    shapes = [tuple(int(part) for part in shape.split("x")) for shape in args.shapes]
    with tempfile.TemporaryDirectory(prefix="attention-loop-") as scratch:
        library = compile_loop(Path(scratch))
        results = [compare(library, rows, length, capacity, args.calls, args.rounds) for rows, length, capacity in shapes]
    result = {"command": shlex.join(["python", "-m", "bench.attention_kernel", *(sys.argv[1:] if argv is None else argv)]),
              "machine": machine.describe(), "compiler_flags": list(FLAGS), "heads": HEADS, "head_dim": HEAD_DIM,
              "shapes": results}
    lines = ["# The step's attention: onnxruntime's kernel against plain loops", "", f"Command: `{result['command']}`", "",
             (f"One query position per row, {HEADS} heads of {HEAD_DIM}, an int8 cache with per-tensor scales, one thread; "
              f"microseconds per call, median of {args.rounds} alternating rounds of {args.calls} calls (the loop "
              f"compiled with `{' '.join(FLAGS[:-1])}`)."), "",
             ("| rows | length | columns | GroupQueryAttention us | loops us | per row and head, us | ratio | "
              "largest difference | same cache |"), "|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        per = row["us_per_row_head"]
        lines.append(f"| {row['rows']} | {row['length']} | {row['capacity']} | {row['us'][GQA]:.1f} | {row['us'][LOOP]:.1f} | "
                     f"{per[GQA]:.3f} / {per[LOOP]:.3f} | {row['ratio']:.2f} | {row['max_difference']:.1e} | "
                     f"{'yes' if row['same_cache'] else 'no'} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_kernel.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (args.out / "attention_kernel.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
