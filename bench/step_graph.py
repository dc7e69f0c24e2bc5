"""What a decoder step costs a running batch: the merged decoder with a shared cache length
against the step graph over each row's own length (`export.step_graph`), in-process.

    python -m bench.step_graph --model models/translate-en-it --out bench/results/step_graph_cpu.json

For each batch size and oldest row's length P: the service's decoder (int8 on the CPU) steps
B rows whose cache is P columns long (every row padded to the oldest, as the running batch
did before the step graph), and the repository's step graph (`decoder_step.onnx` of the same
variant) steps B rows whose own lengths are drawn from 0..P (one at P) in buffers of
`--capacity` columns, written in place. One intra-op thread (as each batch worker has); the
median of `--repeats` timed calls of each, the two graphs called in turn, each call with its
Python binding work included.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine

BATCHES = (1, 2, 4, 8, 20, 32, 64)
PASTS = (8, 20, 40, 67, 120)


def _paired_median_ms(first: Any, second: Any, repeats: int) -> tuple[float, float]:
    """Median milliseconds of each call, the two called in turn (this machine's speed drifts
    within seconds: timing one after the other would compare two machines)."""
    first(), second()  # first-call allocations
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for call, spent in ((first, times[0]), (second, times[1])):
            started = time.perf_counter()
            call()
            spent.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times[0]), 3), round(1000 * statistics.median(times[1]), 3)


def measure(model_dir: Path, source_len: int, capacity: int, repeats: int, seed: int = 0) -> dict[str, Any]:
    from service.runtime import KVCache, ModelRuntime
    from service.runtime.step_buffers import CacheBuffers, run_step

    runtime = ModelRuntime.load(model_dir, providers=["CPUExecutionProvider"], threads=1, spinning=False)
    session = runtime.step
    if session is None:
        raise SystemExit(f"{model_dir}: variant {runtime.variant} has no step graph (decoder_step.onnx)")
    if {i.name: i.type for i in session.get_inputs()}["past_key.0"] != "tensor(float)":
        raise SystemExit(f"{model_dir}: the {runtime.variant} step graph's cache is not float32 (an int8 cache, "
                         "export.kv_cache): this comparison feeds float buffers; use a repository with a float cache")
    rng = np.random.default_rng(seed)
    layers, heads, head_dim = runtime.n_decoder_layers, runtime.n_heads, runtime.head_dim
    rows = []
    for batch in BATCHES:
        state = runtime.encode(runtime.pad([[5] * (source_len - 1) + [runtime.eos_id]] * batch))
        cross = [np.asarray(t) for pair in zip(state.cross_keys, state.cross_values, strict=True) for t in pair]
        tokens = np.full((batch, 1), 7, dtype=np.int64)
        for past in PASTS:
            shared = rng.standard_normal((batch, heads, past, head_dim)).astype(np.float32)
            cache = KVCache([shared] * layers, [shared] * layers)
            positions = np.full((batch, 1), past, dtype=np.int64)
            mask = np.ones((batch, past + 1), dtype=bool)
            own = rng.integers(0, past + 1, batch)
            own[0] = past
            buffers = CacheBuffers(layers, batch, heads, capacity, head_dim)
            merged, step = _paired_median_ms(
                functools.partial(runtime.decode, tokens, state, cache, positions=positions, target_mask=mask),
                functools.partial(run_step, session, tokens, own[:, None], state.source_mask, cross, buffers), repeats)
            rows.append({"batch": batch, "oldest": past, "mean_own_length": round(float(own.mean()), 1),
                         "merged_decoder_ms": merged, "step_graph_ms": step, "ratio": round(step / merged, 2)})
            print(f"B {batch:3d} P {past:4d}: merged {merged:.3f} ms, step graph {step:.3f} ms "
                  f"({step / merged:.2f})", flush=True)
    return {"variant": runtime.variant, "source_len": source_len, "capacity": capacity, "repeats": repeats,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/step_graph_cpu.json"))
    parser.add_argument("--source-len", type=int, default=24)
    parser.add_argument("--capacity", type=int, default=128, help="cache columns of the step graph's buffers")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    result = measure(args.model, args.source_len, args.capacity, args.repeats)
    result.update(command="python -m bench.step_graph " + shlex.join(sys.argv[1:] if argv is None else argv),
                  machine=machine.describe())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
