"""What one decoder layer's cross-attention costs a step, by source width: the float products
of the step graph (scores = q Kᵀ, masked softmax, p V) against onnxruntime's
`MultiHeadAttention` contrib operator on the same keys/values, one intra-op thread.

    python -m bench.cross_attention --out bench/results/batch-size/cross_attention.json

Each graph takes one new position per row (`--rows`, `--heads` of `--head-dim`) and the rows'
cross keys/values over `width` source columns (each row's own source length drawn below it, the
rest masked); the two graphs run in turn, `--calls` timed calls each after a warm-up, for every
width of `--widths`; the output gives the median milliseconds per call of each and the bytes of
keys and values read per millisecond.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine

PRODUCTS = "MatMul, Softmax, MatMul (the step graph's)"
CONTRIB = "MultiHeadAttention (com.microsoft)"


def _session(model: Any) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def graphs(rows: int, heads: int, head_dim: int, width: int) -> dict[str, Any]:
    """The two formulations as sessions, each with the names of its inputs."""
    from onnx import TensorProto, helper

    embed = heads * head_dim
    floats = TensorProto.FLOAT

    def value(name: str, kind: int, shape: list[int]) -> Any:
        return helper.make_tensor_value_info(name, kind, shape)

    cache = [value("k", floats, [rows, heads, width, head_dim]), value("v", floats, [rows, heads, width, head_dim])]
    products = helper.make_graph(
        [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
         helper.make_node("MatMul", ["q", "kt"], ["scores"]),
         helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
         helper.make_node("Where", ["mask", "scaled", "low"], ["masked"]),
         helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
         helper.make_node("MatMul", ["p", "v"], ["heads_out"]),
         helper.make_node("Transpose", ["heads_out"], ["rows_out"], perm=[0, 2, 1, 3]),
         helper.make_node("Reshape", ["rows_out", "shape"], ["out"])],
        "products", [value("q", floats, [rows, heads, 1, head_dim]), *cache,
                     value("mask", TensorProto.BOOL, [rows, 1, 1, width])],
        [value("out", floats, [rows, 1, embed])],
        [helper.make_tensor("scale", floats, [], [head_dim ** -0.5]),
         helper.make_tensor("low", floats, [], [-1e9]),
         helper.make_tensor("shape", TensorProto.INT64, [3], [0, 1, embed])])
    contrib = helper.make_graph(
        [helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "mask"], ["out"],
                          domain="com.microsoft", num_heads=heads)],
        "contrib", [value("q", floats, [rows, 1, embed]), *cache, value("mask", TensorProto.INT32, [rows, width])],
        [value("out", floats, [rows, 1, embed])])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return {PRODUCTS: _session(helper.make_model(products, opset_imports=opsets[:1])),
            CONTRIB: _session(helper.make_model(contrib, opset_imports=opsets))}


def feeds(rows: int, heads: int, head_dim: int, width: int, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """The same query, keys, values and source lengths in each formulation's layout."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((rows, heads, 1, head_dim), dtype=np.float32)
    k = rng.standard_normal((rows, heads, width, head_dim), dtype=np.float32)
    v = rng.standard_normal((rows, heads, width, head_dim), dtype=np.float32)
    lengths = rng.integers(1, width + 1, rows)
    lengths[0] = width  # the longest row sets the width
    valid = np.arange(width)[None, :] < lengths[:, None]
    return {PRODUCTS: {"q": q, "k": k, "v": v, "mask": valid[:, None, None, :]},
            CONTRIB: {"q": q.transpose(0, 2, 1, 3).reshape(rows, 1, heads * head_dim), "k": k, "v": v,
                      "mask": valid.astype(np.int32)}}


def measure(rows: int, heads: int, head_dim: int, width: int, calls: int) -> dict[str, Any]:
    """Median ms per call of each formulation at `width`, and their largest output difference."""
    sessions = graphs(rows, heads, head_dim, width)
    inputs = feeds(rows, heads, head_dim, width)
    outputs = {name: session.run(None, inputs[name])[0] for name, session in sessions.items()}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(calls // 10):
        for name, session in sessions.items():  # in turn, ten calls at a time
            started = time.perf_counter()
            for _ in range(10):
                session.run(None, inputs[name])
            times[name].append((time.perf_counter() - started) / 10 * 1000)
    read = 2 * rows * heads * width * head_dim * 4  # float32 keys and values
    return {"width": width, "keys_values_bytes": read,
            "max_difference": float(np.abs(outputs[PRODUCTS] - outputs[CONTRIB]).max()),
            "ms": {name: round(statistics.median(values), 3) for name, values in times.items()},
            "gb_per_s": {name: round(read / 1e6 / statistics.median(values), 2) for name, values in times.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/batch-size/cross_attention.json"))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128, 192])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    results = {
        "command": "python -m bench.cross_attention " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine.describe(), "rows": args.rows, "heads": args.heads, "head_dim": args.head_dim,
        "widths": [measure(args.rows, args.heads, args.head_dim, width, max(args.calls, 10))
                   for width in args.widths],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    for row in results["widths"]:
        print(f"width {row['width']}: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in row["ms"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
