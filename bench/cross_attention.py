"""What one decoder layer's cross-attention costs a step, by source width: the float products
of the step graph (scores = q Kᵀ, masked softmax, p V) against onnxruntime's
`MultiHeadAttention` contrib operator on the same keys/values, and against its
`GroupQueryAttention` over each row's own source length, one intra-op thread.

`GroupQueryAttention` attends over a row's past keys/values up to its `seqlens_k` and appends
the new position's: given the cross keys/values as the past, `seqlens_k` = the row's source
length - 1 and, as the "new" key/value, the row's own last source position (which it writes
where it already is: past and present bound to one buffer), it attends over exactly the row's
source, reading nothing of the padding.

    python -m bench.cross_attention --out bench/results/batch-size/cross_attention.json

Each graph takes one new position per row (`--rows`, `--heads` of `--head-dim`) and the rows'
cross keys/values over `width` source columns (each row's own source length drawn below it, the
rest masked); the two graphs run in turn, `--calls` timed calls each after a warm-up, for every
width of `--widths`; the output gives the median milliseconds per call of each and the bytes of
keys and values read per millisecond. With `--model` and `--data-dir`, the rows' source lengths
are instead those of `--batches` runs of consecutive test sentences (as they would arrive), each
at the width of its longest rounded up to 32 columns, as the slot batch pads it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine

PRODUCTS = "MatMul, Softmax, MatMul (the step graph's)"
CONTRIB = "MultiHeadAttention (com.microsoft)"
OWN_LENGTH = "GroupQueryAttention over each row's own length (com.microsoft)"


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
    own_length = helper.make_graph(
        [helper.make_node("GroupQueryAttention", ["q", "k_last", "v_last", "k", "v", "seqlens", "total"],
                          ["out", "k_out", "v_out"], domain="com.microsoft", num_heads=heads, kv_num_heads=heads)],
        "own_length", [value("q", floats, [rows, 1, embed]), value("k_last", floats, [rows, 1, embed]),
                       value("v_last", floats, [rows, 1, embed]), *cache,
                       value("seqlens", TensorProto.INT32, [rows]), value("total", TensorProto.INT32, [])],
        [value("out", floats, [rows, 1, embed]), value("k_out", floats, [rows, heads, width, head_dim]),
         value("v_out", floats, [rows, heads, width, head_dim])])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return {PRODUCTS: _session(helper.make_model(products, opset_imports=opsets[:1])),
            CONTRIB: _session(helper.make_model(contrib, opset_imports=opsets)),
            OWN_LENGTH: _session(helper.make_model(own_length, opset_imports=opsets))}


def feeds(rows: int, heads: int, head_dim: int, width: int, seed: int = 0,
          lengths: np.ndarray | None = None) -> dict[str, dict[str, np.ndarray]]:
    """The same query, keys, values and source lengths (`lengths`, or drawn below `width`) in
    each formulation's layout."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((rows, heads, 1, head_dim), dtype=np.float32)
    k = rng.standard_normal((rows, heads, width, head_dim), dtype=np.float32)
    v = rng.standard_normal((rows, heads, width, head_dim), dtype=np.float32)
    if lengths is None:
        lengths = rng.integers(1, width + 1, rows)
        lengths[0] = width  # the longest row sets the width
    valid = np.arange(width)[None, :] < lengths[:, None]
    by_row = q.transpose(0, 2, 1, 3).reshape(rows, 1, heads * head_dim)
    last = np.arange(rows), slice(None), lengths - 1  # each row's last source position
    return {PRODUCTS: {"q": q, "k": k, "v": v, "mask": valid[:, None, None, :]},
            CONTRIB: {"q": by_row, "k": k, "v": v, "mask": valid.astype(np.int32)},
            OWN_LENGTH: {"q": by_row, "k": k, "v": v, "k_last": k[last].reshape(rows, 1, -1),
                         "v_last": v[last].reshape(rows, 1, -1),
                         "seqlens": (lengths - 1).astype(np.int32), "total": np.array(width, dtype=np.int32)}}


def _runner(name: str, session: Any, inputs: dict[str, np.ndarray]) -> tuple[Callable[[], None], Callable[[], np.ndarray]]:
    """(one call, the attention output) of a session; `GroupQueryAttention`'s keys/values bound
    in place (its present outputs to its past inputs' buffers), as a step graph binds them."""
    import onnxruntime as ort

    if name != OWN_LENGTH:
        return (lambda: session.run(None, inputs)), (lambda: session.run(None, inputs)[0])
    binding = session.io_binding()
    binding.bind_output("out")  # first: `get_outputs` lists the bound outputs in binding order
    for key, array in inputs.items():
        if key in ("k", "v"):
            buffer = ort.OrtValue.ortvalue_from_numpy(array.copy())
            binding.bind_ortvalue_input(key, buffer)
            binding.bind_ortvalue_output(f"{key}_out", buffer)
        else:
            binding.bind_cpu_input(key, array)

    def output() -> np.ndarray:
        session.run_with_iobinding(binding)
        return np.asarray(binding.get_outputs()[0].numpy())

    return (lambda: session.run_with_iobinding(binding)), output


def measure(rows: int, heads: int, head_dim: int, width: int, calls: int,
            lengths: np.ndarray | None = None) -> dict[str, Any]:
    """Median ms per call of each formulation at `width` (rows of `lengths`, if given), and
    their largest output difference."""
    sessions = graphs(rows, heads, head_dim, width)
    inputs = feeds(rows, heads, head_dim, width, lengths=lengths)
    runners = {name: _runner(name, session, inputs[name]) for name, session in sessions.items()}
    outputs = {name: output() for name, (_, output) in runners.items()}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(calls // 10):
        for name, (call, _) in runners.items():  # in turn, ten calls at a time
            started = time.perf_counter()
            for _ in range(10):
                call()
            times[name].append((time.perf_counter() - started) / 10 * 1000)
    read = 2 * rows * heads * width * head_dim * 4  # float32 keys and values
    return {"width": width, "keys_values_bytes": read,
            "mean_source_length": float(inputs[OWN_LENGTH]["seqlens"].mean() + 1),
            "max_difference": {name: float(np.abs(outputs[name] - outputs[PRODUCTS]).max())
                               for name in (CONTRIB, OWN_LENGTH)},
            "ms": {name: round(statistics.median(values), 3) for name, values in times.items()},
            "gb_per_s": {name: round(read / 1e6 / statistics.median(values), 2) for name, values in times.items()}}


def _test_lengths(model_dir: Path, data_dir: Path, rows: int, batches: int) -> list[np.ndarray]:
    """Source lengths (tokens and EOS, within the model's window) of `batches` runs of `rows`
    consecutive test sentences of the model."""
    from model.tokenizer import Tokenizer
    from service.repository.manifest import read_manifest

    manifest = read_manifest(model_dir)
    tokenizer = Tokenizer.from_file(model_dir / "tokenizer.model")
    lines = (data_dir / manifest.name / "test.src").read_text(encoding="utf-8").splitlines()[: rows * batches]
    lengths = np.array([min(len(tokenizer.encode(line)), manifest.max_source_len - 1) + 1 for line in lines])
    return [lengths[i * rows:(i + 1) * rows] for i in range(len(lengths) // rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/batch-size/cross_attention.json"))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128, 192])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--model", type=Path, default=None,
                        help="a model folder: the rows' lengths from its test sentences (with --data-dir)")
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--batches", type=int, default=4, help="with --model: runs of consecutive sentences")
    args = parser.parse_args(argv)
    runs: list[tuple[int, np.ndarray | None]]
    if args.model is None:
        runs = [(width, None) for width in args.widths]
    else:
        runs = [(-(-int(lengths.max()) // 32) * 32, lengths)
                for lengths in _test_lengths(args.model, args.data_dir, args.rows, args.batches)]
    results = {
        "command": "python -m bench.cross_attention " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine.describe(), "rows": args.rows, "heads": args.heads, "head_dim": args.head_dim,
        "widths": [measure(args.rows, args.heads, args.head_dim, width, max(args.calls, 10), lengths)
                   for width, lengths in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    for row in results["widths"]:
        print(f"width {row['width']}: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in row["ms"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
