"""Variants of a repository's int8 graphs and of the running batch's encoder grouping, against
the shipped ones, and onnxruntime's attention kernel alone at the step's shapes.

    python -m bench.step_variants --model models/translate-en-it --data-dir data --out bench/results/step-variants

Each graph variant is a copy of the repository with its int8 encoder and step graph rewritten
(`VARIANTS`, the manifest hashed anew):
- `re-saved`: the graphs unchanged, saved as the others are (each with its weights in a file of
  its own): the control for what the saving alone does;
- `skip-layer-norm`: each residual Add and the LayerNormalization after it fused into one
  `SkipLayerNormalization` node (onnxruntime's contrib operator, which keeps the sum as a fourth
  output where the residual goes on: `fuse_skip_layer_norms`), ten fewer nodes per step;
- `float-self-cache`: the step graph's self-attention cache in float32 again, its cross
  keys/values still int8 (`export.kv_cache` quantizes both);
- `packed-projections`: each self-attention's query, key and value as one int8 product, packed
  into its kernel (`export.fused_projections`; run it on a repository exported before the int8
  export did this);
- `split-projections`: that, and in the encoder each group of projections of one activation (a
  layer's query, key and value; the cross keys/values of every decoder layer) as one product
  followed by a `Split`.
`--padding-slacks` adds the shipped repository with newcomers encoded in groups padded to at
most that many times their tokens (`SlotBatch(padding_slack=...)`, 1.25 by default).

All of them replay the first `--sentences` test sources through one running batch of up to
`--rows` slots, `--group` newcomers joining at a time (`bench.join_cost.replay`, one thread), in
`--turns` alternating turns; the report gives each one's seconds (whole replay, decoder steps,
joins) and the share of sentences whose greedy tokens are the shipped graphs'.

`--attention` times onnxruntime's `GroupQueryAttention` alone (one query position, 4 heads of
64, each row's cache `length` long inside a buffer of `capacity` columns, one thread) with the
cache in int8 (per-tensor scales, as the shipped step graphs), float32 and float16: what one of
the step's six attention calls costs by rows and length, and what the cache's type does to it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from bench import machine
from export import fused_norms
from export.fused_projections import fuse_shared_projections
from export.kv_cache import QUANT_ATTRIBUTES, SCALE_INPUTS, has_int8_cache
from service.repository import graph_io
from service.repository.manifest import read_manifest, write_manifest

SHIPPED = "shipped"
ATTENTION_SHAPES = ((1, 8, 64), (1, 32, 64), (64, 8, 64), (64, 32, 64), (64, 32, 256), (64, 64, 128))  # rows, length, capacity
ATTENTION_CACHES = {"int8": TensorProto.INT8, "float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
HEADS, HEAD_DIM = 4, 64
ATTENTION_SCALE = 0.05  # the int8 caches' per-tensor scales


def _int8_graphs(directory: Path) -> list[Path]:
    """The int8 variant's encoder and step graph of the repository `directory`."""
    entry = read_manifest(directory).variants.get("int8")
    if entry is None or not entry.step_decoder:
        raise ValueError(f"{directory}: no int8 variant with a step graph")
    return [directory / entry.encoder, directory / entry.step_decoder]


def fuse_skip_layer_norms(graph: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `graph` with each residual Add and its LayerNormalization as one
    `SkipLayerNormalization` (`export.fused_norms`). Raises ValueError when the graph has no such
    pair (a variant must differ from the shipped graph)."""
    graph = onnx.ModelProto.FromString(graph.SerializeToString())
    if not fused_norms.fuse_skip_layer_norms(graph):
        raise ValueError("no Add followed by a LayerNormalization over the last axis to fuse")
    return graph


def float_self_cache(graph: onnx.ModelProto) -> onnx.ModelProto:
    """The int8-cache step graph `graph` (`export.kv_cache.int8_cache_graph`) with its
    self-attention cache in float32: the self-attention nodes lose their scales and quantization
    attributes, the past/present inputs and outputs become float; the cross keys/values stay int8."""
    if not has_int8_cache(graph):
        raise ValueError("this step graph has no int8 cache (export.kv_cache)")
    graph = onnx.ModelProto.FromString(graph.SerializeToString())
    body = graph.graph
    changed = 0
    for node in body.node:
        if node.op_type != "GroupQueryAttention" or not node.input[3].startswith("past_key."):
            continue
        inputs = list(node.input)[:SCALE_INPUTS]  # the key and value scales go
        while inputs and not inputs[-1]:
            inputs.pop()
        del node.input[:]
        node.input.extend(inputs)
        kept = [attribute for attribute in node.attribute if attribute.name not in QUANT_ATTRIBUTES]
        del node.attribute[:]
        node.attribute.extend(kept)
        changed += 1
    used = {name for node in body.node for name in node.input}
    initializers = [tensor for tensor in body.initializer if tensor.name in used]
    del body.initializer[:]
    body.initializer.extend(initializers)
    cache = (*graph_io.past_names(changed), *graph_io.present_names(changed))
    for value in (*body.input, *body.output):
        if value.name in cache:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    del body.value_info[:]
    return graph


def _rewrite(directory: Path, rewrites: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]]) -> None:
    """Rewrite the int8 encoder and step graph of `directory` in place (`rewrites` by "encoder" /
    "step"; each rewritten graph's weights in a file of its own beside it) and hash the manifest
    anew."""
    for kind, path in zip(("encoder", "step"), _int8_graphs(directory), strict=True):
        if kind in rewrites:  # the weights beside the graph (the variant's others keep the shared file)
            onnx.save_model(rewrites[kind](onnx.load_model(str(path))), str(path), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=f"{path.stem}.data")
    write_manifest(directory, read_manifest(directory))


def split_projections(graph: onnx.ModelProto) -> onnx.ModelProto:
    """`graph` with the int8 projections of each shared activation as one product, split apart
    after it where no attention kernel takes them packed (`fuse_shared_projections(split=True)`)."""
    fuse_shared_projections(graph, split=True)
    return graph


def packed_projections(graph: onnx.ModelProto) -> onnx.ModelProto:
    """`graph` with each self-attention's query, key and value as one product, packed into the
    kernel (`fuse_shared_projections`, what the int8 export does)."""
    fuse_shared_projections(graph)
    return graph


def unchanged(graph: onnx.ModelProto) -> onnx.ModelProto:
    """`graph` as it is: the control, saved as the rewritten graphs are (weights beside it)."""
    return graph


VARIANTS: dict[str, dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]]] = {
    "re-saved": {"encoder": unchanged, "step": unchanged},
    "skip-layer-norm": {"encoder": fuse_skip_layer_norms, "step": fuse_skip_layer_norms},
    "float-self-cache": {"step": float_self_cache},
    "packed-projections": {"step": packed_projections},
    "split-projections": {"encoder": split_projections, "step": packed_projections},
}


def variant_repository(source: Path, variant: str, out: Path) -> Path:
    """A copy of the repository `source` at `out` with `variant`'s rewrites."""
    shutil.copytree(source, out)
    _rewrite(out, VARIANTS[variant])
    return out


def attention_graph(cache: int) -> bytes:
    """One GroupQueryAttention over (B, 1, 256) float queries, keys and values and a (B, 4, C, 64)
    cache of type `cache` (int8: per-tensor scales `ATTENTION_SCALE` as inputs), past and present
    bound alike."""
    compute = TensorProto.FLOAT16 if cache == TensorProto.FLOAT16 else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(name, compute, ["batch", 1, HEADS * HEAD_DIM]) for name in ("q", "k", "v")]
    inputs += [helper.make_tensor_value_info(name, cache, ["batch", HEADS, "capacity", HEAD_DIM]) for name in ("pk", "pv")]
    inputs += [helper.make_tensor_value_info("lengths", TensorProto.INT32, ["batch"]),
               helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    names = ["q", "k", "v", "pk", "pv", "lengths", "total"]
    attributes: dict[str, Any] = {"num_heads": HEADS, "kv_num_heads": HEADS}
    initializers = []
    if cache == TensorProto.INT8:  # as export.kv_cache makes it
        names += [""] * (SCALE_INPUTS - len(names)) + ["key_scale", "value_scale"]
        attributes.update(QUANT_ATTRIBUTES)
        initializers = [helper.make_tensor(name, TensorProto.FLOAT, [1], [ATTENTION_SCALE])
                        for name in ("key_scale", "value_scale")]
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_k", "present_v"], domain="com.microsoft",
                            **attributes)
    outputs = [helper.make_tensor_value_info("out", compute, None), helper.make_tensor_value_info("present_k", cache, None),
               helper.make_tensor_value_info("present_v", cache, None)]
    body = helper.make_graph([node], "attention", inputs, outputs, initializers)
    return helper.make_model(body, opset_imports=[helper.make_opsetid("", 18),
                                                  helper.make_opsetid("com.microsoft", 1)]).SerializeToString()


def attention_inputs(cache: str, rows: int, length: int, capacity: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs of `attention_graph`: one query position per row, each row's cache `length`
    long (its new key and value go to column `length` - 1) in `capacity` columns of type `cache`."""
    kind = ATTENTION_CACHES[cache]
    rng = np.random.default_rng(seed)
    dtype = {TensorProto.INT8: np.int8, TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}[kind]
    compute = np.float16 if kind == TensorProto.FLOAT16 else np.float32
    inputs = {name: rng.standard_normal((rows, 1, HEADS * HEAD_DIM)).astype(compute) for name in ("q", "k", "v")}
    for name in ("pk", "pv"):
        inputs[name] = (rng.integers(-100, 100, (rows, HEADS, capacity, HEAD_DIM)).astype(np.int8)
                        if kind == TensorProto.INT8 else
                        rng.standard_normal((rows, HEADS, capacity, HEAD_DIM)).astype(dtype))
    inputs["lengths"] = np.full(rows, length - 1, dtype=np.int32)
    inputs["total"] = np.array(capacity, dtype=np.int32)
    return inputs


def attention_runner(cache: str, inputs: dict[str, np.ndarray]
                     ) -> tuple[Callable[[], None], Callable[[], np.ndarray], Callable[[], tuple[np.ndarray, np.ndarray]]]:
    """GroupQueryAttention on `inputs` (copied; the caches written in place, as the step graph's)
    on one thread: a call, the last call's (rows, 1, 256) output, and the caches."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(attention_graph(ATTENTION_CACHES[cache]), options,
                                   providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    for name in ("q", "k", "v", "lengths", "total"):
        binding.bind_cpu_input(name, inputs[name])
    binding.bind_output("out")  # the first of the outputs copied out
    caches = []
    for past_name, present_name in (("pk", "present_k"), ("pv", "present_v")):
        value = ort.OrtValue.ortvalue_from_numpy(inputs[past_name].copy())
        binding.bind_ortvalue_input(past_name, value)
        binding.bind_ortvalue_output(present_name, value)  # written in place, as the step graph's cache
        caches.append(value)
    return (lambda: session.run_with_iobinding(binding)), (lambda: binding.copy_outputs_to_cpu()[0]), \
        (lambda: (caches[0].numpy(), caches[1].numpy()))


def median_us(call: Callable[[], None], calls: int, rounds: int = 5) -> float:
    """Microseconds per call of `call`: the median of `rounds` rounds of `calls` after a warm-up."""
    for _ in range(max(calls // 5, 5)):
        call()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(times)


def attention_us(cache: str, rows: int, length: int, capacity: int, calls: int, seed: int = 0) -> float:
    """Microseconds per GroupQueryAttention call (median of 5 rounds of `calls`) at one query
    position per row, each row's cache `length` long in `capacity` columns of type `cache`."""
    call, _, _ = attention_runner(cache, attention_inputs(cache, rows, length, capacity, seed))
    return median_us(call, calls)


ALONE_SHAPES = (("step", 1), ("step", 64), ("encoder", 1), ("encoder", 16))  # graph, rows
ALONE_SIZES = {"capacity": 64, "source_len": 40}  # the step's cache columns and source width
ENCODER_TOKENS = 32  # the encoder's source length


def _alone_feed(session: ort.InferenceSession, kind: str, rows: int, rng: np.random.Generator) -> dict[str, Any]:
    """Random inputs of the int8 graph `kind` at `rows` rows: the encoder `ENCODER_TOKENS` ids a
    row; the step graph each row 10-29 cached positions in `ALONE_SIZES["capacity"]` columns and
    a source of 11-40 positions."""
    if kind == "encoder":
        return {"input_ids": rng.integers(4, 1000, (rows, ENCODER_TOKENS))}
    sizes = {"batch": rows, **ALONE_SIZES}
    feed: dict[str, Any] = {}
    for value in session.get_inputs():
        shape = [d if isinstance(d, int) else sizes[d] for d in value.shape]
        if value.name == "positions":
            feed[value.name] = rng.integers(10, 30, shape)
        elif value.name == graph_io.SOURCE_LAST:
            feed[value.name] = rng.integers(10, ALONE_SIZES["source_len"], shape).astype(np.int32)
        elif value.type == "tensor(int64)":
            feed[value.name] = rng.integers(4, 1000, shape)
        elif value.type == "tensor(int8)":
            feed[value.name] = rng.integers(-100, 100, shape).astype(np.int8)
        elif value.type == "tensor(bool)":
            feed[value.name] = np.ones(shape, dtype=bool)
        else:
            feed[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feed


def alone_ms(repositories: dict[str, Path], calls: int, rounds: int = 12, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Milliseconds per call of each repository's int8 step graph and encoder called alone (one
    thread, the same random inputs for every arm, `ALONE_SHAPES`), the arms in alternating order
    each round: per shape and arm the median of `rounds` rounds of `calls` calls and each round's
    ratio to the first arm's."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    sessions = {name: dict(zip(("encoder", "step"), (ort.InferenceSession(str(path), options,
                                                                         providers=["CPUExecutionProvider"])
                                                    for path in _int8_graphs(directory)), strict=True))
                for name, directory in repositories.items()}
    first = next(iter(sessions))
    result: dict[str, dict[str, Any]] = {}
    for kind, rows in ALONE_SHAPES:
        rng = np.random.default_rng(seed)
        feed = _alone_feed(sessions[first][kind], kind, rows, rng)
        outputs = [o.name for o in sessions[first][kind].get_outputs() if not o.name.startswith("encoder_attention")]
        count = max(calls // rows if kind == "step" else calls // (4 * rows), 5)
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for turn in range(rounds):
            for name in (list(sessions) if turn % 2 == 0 else list(sessions)[::-1]):
                session = sessions[name][kind]
                session.run(outputs, feed)
                start = time.perf_counter()
                for _ in range(count):
                    session.run(outputs, feed)
                times[name].append((time.perf_counter() - start) / count * 1e3)
        result[f"{kind} x{rows}"] = {name: {"median_ms": statistics.median(t),
                                             "ratios": [round(a / b, 3) for a, b in zip(t, times[first], strict=True)]}
                                      for name, t in times.items()}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_variants", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--padding-slacks", nargs="*", type=float, default=[],
                        help="also the shipped graphs with newcomers encoded at each of these padding slacks")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--attention", action="store_true", help="also time GroupQueryAttention alone")
    parser.add_argument("--calls", type=int, default=300,
                        help="attention calls per round (--attention); a lone row's step calls per round (--alone)")
    parser.add_argument("--alone", action="store_true",
                        help="also time each arm's int8 step graph and encoder called alone at fixed shapes")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from bench import workload as workload_module
    from bench.join_cost import replay
    from service.batching.slot_batch import SlotBatch, generate_running
    from service.runtime import CPU, ModelRuntime

    def load(directory: Path) -> ModelRuntime:
        return ModelRuntime.load(directory, [CPU], threads=1, spinning=False, memory_arena=False, variant="int8")

    result: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "bench.step_variants", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine.describe(), "model": args.model.name, "rows": args.rows, "group": args.group,
        "turns": args.turns,
    }
    lines = ["# Step and encoder variants against the shipped graphs", "", f"Command: `{result['command']}`", ""]
    with tempfile.TemporaryDirectory(prefix="step-variants-") as scratch:
        shipped = load(args.model)
        runtimes = {SHIPPED: shipped}
        for variant in args.variants:
            runtimes[variant] = load(variant_repository(args.model, variant, Path(scratch) / variant))
        nodes = {name: {kind: len(onnx.load_model(str(path), load_external_data=False).graph.node)
                        for kind, path in zip(("encoder", "step"), _int8_graphs(Path(directory)), strict=True)}
                 for name, directory in ((SHIPPED, args.model),
                                         *((v, Path(scratch) / v) for v in args.variants))}
        work = workload_module.load(args.data_dir, args.model.name, shipped.task, shipped.tokenizer,
                                    shipped.max_source_len, args.sentences)
        sources = work.source_ids
        arms: dict[str, tuple[ModelRuntime, float | None]] = {name: (runtime, None) for name, runtime in runtimes.items()}
        arms.update({f"padding slack {slack:g}": (shipped, slack) for slack in args.padding_slacks})
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
        for turn in range(args.turns):
            for name in (list(arms) if turn % 2 == 0 else list(arms)[::-1]):
                runtime, slack = arms[name]
                runs[name].append(replay(runtime, sources, args.rows, args.group,
                                         lambda r, s=slack: SlotBatch(r, padding_slack=s, scores=False)))

        def tokens(runtime: ModelRuntime) -> dict[int, list[int]]:
            decoded = generate_running(runtime, list(enumerate(sources)), rows=args.rows, join_at=args.group)
            return {i: r.tokens for i, r in decoded}

        expected = tokens(shipped)
        same = {name: (1.0 if runtime is shipped else
                       sum(t == expected[i] for i, t in tokens(runtime).items()) / len(expected))
                for name, runtime in runtimes.items()}
        if args.alone:
            result["alone_ms"] = alone_ms({SHIPPED: args.model, **{v: Path(scratch) / v for v in args.variants}},
                                          args.calls)
    result["arms"] = {name: {"median": {key: statistics.median(run[key] for run in arm_runs) for key in arm_runs[0]},
                             "runs": arm_runs, "same_tokens": same.get(name, 1.0), "nodes": nodes.get(name)}
                      for name, arm_runs in runs.items()}
    lines += [(f"The first {len(sources)} test sources through one running batch of up to {args.rows} slots, "
               f"{args.group} newcomers joining at a time, one thread, {args.turns} alternating turns: seconds, median "
               "(range); the share of sentences with the shipped graphs' greedy tokens."), "",
              "| arm | encoder / step nodes | whole replay s | decoder steps s | joins s | same tokens |",
              "|---|---|---|---|---|---|"]
    for name, arm in result["arms"].items():
        def cell(key: str, arm: dict[str, Any] = arm) -> str:
            values = [run[key] for run in arm["runs"]]
            return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"
        count = arm["nodes"]
        nodes_cell = f"{count['encoder']} / {count['step']}" if count else "-"
        lines.append(f"| {name} | {nodes_cell} | {cell('total_s')} | "
                     f"{cell('step_s')} | {cell('join_s')} | {arm['same_tokens']:.3f} |")
    if args.alone:
        arms_alone = list(next(iter(result["alone_ms"].values())))
        lines += ["", (f"Each arm's int8 graphs called alone, one thread, the same random inputs (the step: each row 10-29 "
                       f"cached positions in {ALONE_SIZES['capacity']} columns, a source of 11-{ALONE_SIZES['source_len']}; "
                       f"the encoder: {ENCODER_TOKENS} tokens a row), the arms alternating in 12 rounds: ms per call, "
                       f"median; in brackets the median of the rounds' ratios to {arms_alone[0]}'s."), "",
                  "| arm | " + " | ".join(result["alone_ms"]) + " |", "|---|" + "---|" * len(result["alone_ms"])]
        for name in arms_alone:
            cells = [f"{shape[name]['median_ms']:.3f} ({statistics.median(shape[name]['ratios']):.3f})"
                     for shape in result["alone_ms"].values()]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if args.attention:
        timings = {cache: {f"{rows}x{length}x{capacity}": round(attention_us(cache, rows, length, capacity, args.calls), 1)
                           for rows, length, capacity in ATTENTION_SHAPES} for cache in ATTENTION_CACHES}
        result["attention_us"] = timings
        lines += ["", ("onnxruntime's GroupQueryAttention alone, one thread, one query position per row, 4 heads of 64: "
                       "microseconds per call (median of 5 rounds)."), "",
                  "| cache | " + " | ".join(f"{r} rows, length {n}, {c} columns" for r, n, c in ATTENTION_SHAPES) + " |",
                  "|---|" + "---|" * len(ATTENTION_SHAPES)]
        lines += [f"| {cache} | " + " | ".join(f"{v:.1f}" for v in per_shape.values()) + " |"
                  for cache, per_shape in timings.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_variants.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (args.out / "step_variants.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
