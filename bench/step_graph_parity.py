"""Where a model's step graph on a provider departs from the same graph on the CPU, node by node.

Every node's output becomes a graph output; the first decoder step of a few test sentences (the
encoder run on the CPU, empty caches of `--capacity` columns) runs on the CPU and on
`--provider` with the same inputs, and the report lists, in graph order, the nodes whose
float outputs differ by more than `--tolerance` (and integer outputs that differ at all), with
the logits' largest difference and how many rows pick the same next token. `--host-totals`
feeds each GroupQueryAttention's `total_sequence_length` from the host instead of the graph
(self-attention: the longest row's length after the step; cross-attention: the source width),
which tells a wrong total apart from a wrong kernel:

    python -m bench.step_graph_parity --model models/translate-en-it --variant fp16 \\
        --provider CUDAExecutionProvider [--host-totals] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from bench.report import emit_json
from export.storage import load_graph
from service.runtime import CPU, ModelRuntime
from service.runtime.tensors import to_numpy

GQA = "GroupQueryAttention"
TEXTS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "default_models"


def with_every_output(graph: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, tuple[str, str]]]:
    """A copy whose graph outputs include every node's outputs; output name -> (op type, node name)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(graph)
    known = {o.name for o in copy.graph.output}
    producers = {}
    for node in copy.graph.node:
        for name in node.output:
            if name and name not in known:
                copy.graph.output.append(helper.make_empty_tensor_value_info(name))
                producers[name] = (node.op_type, node.name)
    return copy, producers


def feed_totals_from_host(graph: onnx.ModelProto) -> list[str]:
    """Rewire each GroupQueryAttention's total_sequence_length (input 6) to a new int32 graph input,
    `total.self` for self-attention and `total.cross` for cross-attention (whose "past" is the
    cross keys); returns the names added."""
    added: dict[str, None] = {}
    for node in graph.graph.node:
        if node.op_type == GQA:
            name = "total.cross" if node.input[3].startswith("cross_key") else "total.self"
            node.input[6] = name
            added[name] = None
    for name in added:
        graph.graph.input.append(helper.make_tensor_value_info(name, TensorProto.INT32, []))
    return list(added)


def first_step_feeds(runtime: ModelRuntime, sources: list[list[int]], capacity: int, dtype: type) -> dict[str, np.ndarray]:
    """The step graph's inputs for the first step of `sources`: the start token at position 0,
    empty caches of `capacity` columns, the encoder's cross keys/values."""
    state = runtime.encode(runtime.pad(sources))
    rows, heads, head_dim = len(sources), runtime.n_heads, runtime.head_dim
    feeds = {"input_ids": np.full((rows, 1), runtime.bos_id, np.int64), "positions": np.zeros((rows, 1), np.int64),
             "source_mask": state.source_mask, "total.self": np.array(1, np.int32),
             "total.cross": np.array(state.source_mask.shape[1], np.int32)}
    for i in range(runtime.n_decoder_layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}.{i}"] = np.zeros((rows, heads, capacity, head_dim), dtype)
        feeds[f"cross_key.{i}"] = to_numpy(state.cross_keys[i]).astype(dtype)
        feeds[f"cross_value.{i}"] = to_numpy(state.cross_values[i]).astype(dtype)
    return feeds


def compare(model_dir: Path, variant: str, provider: str, host_totals: bool = False, sentences: int = 8,
            capacity: int = 32, tolerance: float = 0.05, listed: int = 20,
            sources: list[list[int]] | None = None) -> dict[str, Any]:
    """The report of the module docstring, as a dict; `sources` (token ids ending in EOS) instead
    of the first `sentences` lines of the model's test fixture."""
    runtime = ModelRuntime.load(model_dir, [CPU], variant=variant, step_graph=True)
    step_file = runtime.manifest.variants[variant].step_decoder
    if not step_file or runtime.step is None:
        return {"error": f"{model_dir.name}: variant {variant} has no step graph"}
    graph, producers = with_every_output(load_graph(model_dir / step_file))
    if host_totals:
        feed_totals_from_host(graph)
    if sources is None:
        lines = (TEXTS / model_dir.name / "test.src").read_text(encoding="utf-8").splitlines()[:sentences]
        sources = [runtime.tokenizer.encode(line)[: runtime.max_source_len - 1] + [runtime.eos_id] for line in lines]
    cache_type = next(i.type for i in runtime.step.get_inputs() if i.name == "past_key.0")
    feeds = first_step_feeds(runtime, sources, capacity, np.float16 if cache_type == "tensor(float16)" else np.float32)
    serialized = graph.SerializeToString()
    runs = {}
    for name in (CPU, provider):
        session = ort.InferenceSession(serialized, providers=[name])
        wanted = {i.name for i in session.get_inputs()}
        outputs = session.run(None, {k: v for k, v in feeds.items() if k in wanted})
        runs[name] = dict(zip([o.name for o in session.get_outputs()], outputs, strict=True))
    reference, other = runs[CPU], runs[provider]
    departing = []
    for name, (op_type, node) in producers.items():
        a, b = np.asarray(reference[name]), np.asarray(other[name])
        if a.shape != b.shape:
            departing.append({"node": node, "op": op_type, "output": name, "shapes": [list(a.shape), list(b.shape)]})
        elif a.dtype.kind == "f" and a.size:
            difference = float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max())
            if not difference <= tolerance:
                departing.append({"node": node, "op": op_type, "output": name, "max_abs_diff": difference})
        elif a.dtype.kind in "iub" and not np.array_equal(a, b):
            departing.append({"node": node, "op": op_type, "output": name, "values": [a.ravel()[:8].tolist(),
                                                                                     b.ravel()[:8].tolist()]})
    logits_cpu, logits_other = (np.asarray(r["logits"], np.float32) for r in (reference, other))
    return {"model": model_dir.name, "variant": variant, "provider": provider, "host_totals": host_totals,
            "rows": len(sources), "capacity": capacity, "tolerance": tolerance, "nodes": len(graph.graph.node),
            "departing_nodes": len(departing), "first_departing": departing[:listed],
            "logits_max_abs_diff": float(np.abs(logits_cpu - logits_other).max()),
            "same_next_token": int((logits_cpu.argmax(-1) == logits_other.argmax(-1)).sum())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_graph_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--variant", default="fp16")
    parser.add_argument("--provider", default="CUDAExecutionProvider")
    parser.add_argument("--host-totals", action="store_true", help="feed GroupQueryAttention's totals from the host")
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default: print only)")
    args = parser.parse_args(argv)
    if args.provider not in ort.get_available_providers():
        print(f"step_graph_parity: {args.provider} is not available in onnxruntime {ort.__version__}")
        return 1
    report = compare(args.model, args.variant, args.provider, args.host_totals, capacity=args.capacity,
                     tolerance=args.tolerance)
    emit_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
