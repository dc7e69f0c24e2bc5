"""onnxruntime's GroupQueryAttention as the step graph calls it, on each provider, against numpy.

The step graph (`export.step_graph`) calls `com.microsoft.GroupQueryAttention` in two ways: its
self-attention appends one key/value per row at the row's own length (`seqlens_k` = the past
length, `total_sequence_length` = the longest row's length after the step), and its
cross-attention reads each row's own source (`seqlens_k` = source length - 1, the "new"
key/value being the row's last source column). Each case here is one GQA node in float16 run
with `present_*` bound to the `past_*` buffers (as the service binds them) and, separately, with
fresh outputs; the report gives the largest difference of the output from a numpy reference and
whether the new column landed in the cache, per provider:

    python -m bench.gqa_cuda --out bench/results/gpu/<gpu>/gqa.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from bench.report import emit_json

HEADS, HEAD_DIM = 4, 32


def gqa_graph(dtype: int = TensorProto.FLOAT16) -> bytes:
    """One GroupQueryAttention node with the step graph's inputs and outputs."""
    width = HEADS * HEAD_DIM
    inputs = [helper.make_tensor_value_info("query", dtype, ["B", 1, width]),
              helper.make_tensor_value_info("key", dtype, ["B", 1, width]),
              helper.make_tensor_value_info("value", dtype, ["B", 1, width]),
              helper.make_tensor_value_info("past_key", dtype, ["B", HEADS, "C", HEAD_DIM]),
              helper.make_tensor_value_info("past_value", dtype, ["B", HEADS, "C", HEAD_DIM]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("output", dtype, ["B", 1, width]),
               helper.make_tensor_value_info("present_key", dtype, ["B", HEADS, "C", HEAD_DIM]),
               helper.make_tensor_value_info("present_value", dtype, ["B", HEADS, "C", HEAD_DIM])]
    node = helper.make_node("GroupQueryAttention", [i.name for i in inputs], [o.name for o in outputs],
                            domain="com.microsoft", num_heads=HEADS, kv_num_heads=HEADS)
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return model.SerializeToString()


def reference(query: np.ndarray, key: np.ndarray, value: np.ndarray, past_key: np.ndarray, past_value: np.ndarray,
              seqlens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row b writes its new key/value at column seqlens[b] and attends over columns 0..seqlens[b]."""
    batch = query.shape[0]
    keys, values = past_key.astype(np.float32).copy(), past_value.astype(np.float32).copy()
    q = query.astype(np.float32).reshape(batch, HEADS, HEAD_DIM)
    out = np.zeros((batch, HEADS, HEAD_DIM), np.float32)
    for b in range(batch):
        at = int(seqlens[b])
        keys[b, :, at] = key[b, 0].astype(np.float32).reshape(HEADS, HEAD_DIM)
        values[b, :, at] = value[b, 0].astype(np.float32).reshape(HEADS, HEAD_DIM)
        scores = np.einsum("hd,hsd->hs", q[b], keys[b, :, :at + 1]) / np.sqrt(HEAD_DIM)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out[b] = np.einsum("hs,hsd->hd", weights, values[b, :, :at + 1])
    return out.reshape(batch, 1, HEADS * HEAD_DIM), keys, values


def cases(rng: np.random.Generator) -> dict[str, dict[str, Any]]:
    """The step graph's calls: self-attention at mixed, equal and zero lengths; cross-attention."""
    found = {}
    for name, lengths, capacity, total in [
        ("self, mixed past lengths", [0, 3, 7], 16, 8),
        ("self, equal past lengths", [5, 5, 5], 16, 6),
        ("self, first step (all empty)", [0, 0, 0], 16, 1),
        ("cross, own source lengths", [9, 5, 2], 10, 10),  # source lengths 10, 6, 3: seqlens = length - 1
    ]:
        batch, width = len(lengths), HEADS * HEAD_DIM
        past = rng.standard_normal((2, batch, HEADS, capacity, HEAD_DIM)).astype(np.float16)
        q, k, v = (rng.standard_normal((batch, 1, width)).astype(np.float16) for _ in range(3))
        if name.startswith("cross"):  # the new key/value is the row's own last column
            k = np.stack([past[0, b, :, lengths[b]].reshape(width) for b in range(batch)])[:, None].astype(np.float16)
            v = np.stack([past[1, b, :, lengths[b]].reshape(width) for b in range(batch)])[:, None].astype(np.float16)
        found[name] = {"query": q, "key": k, "value": v, "past_key": past[0], "past_value": past[1],
                       "seqlens_k": np.array(lengths, np.int32), "total_sequence_length": np.array(total, np.int32)}
    return found


def run_case(session: ort.InferenceSession, device: str, feeds: dict[str, np.ndarray], shared: bool) -> dict[str, Any]:
    """One call; `shared` binds present_* to the past_* buffers (in place)."""
    expected, keys, values = reference(feeds["query"], feeds["key"], feeds["value"], feeds["past_key"],
                                       feeds["past_value"], feeds["seqlens_k"])
    binding = session.io_binding()
    held = {}
    for name, array in feeds.items():
        on = "cpu" if name == "total_sequence_length" else device
        held[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), on, 0)
        binding.bind_ortvalue_input(name, held[name])
    binding.bind_output("output", device)
    if shared:
        binding.bind_ortvalue_output("present_key", held["past_key"])
        binding.bind_ortvalue_output("present_value", held["past_value"])
    else:
        binding.bind_output("present_key", device)
        binding.bind_output("present_value", device)
    try:
        session.run_with_iobinding(binding)
    except Exception as error:  # noqa: BLE001 - a kernel's refusal is the finding
        return {"error": f"{type(error).__name__}: {error}"}
    outputs = binding.copy_outputs_to_cpu()
    output = outputs[0].astype(np.float32)
    present_key = held["past_key"].numpy() if shared else outputs[1]
    present_value = held["past_value"].numpy() if shared else outputs[2]
    written = [bool(np.allclose(present_key[b, :, int(at)].astype(np.float32), keys[b, :, int(at)], atol=1e-3)
                    and np.allclose(present_value[b, :, int(at)].astype(np.float32), values[b, :, int(at)], atol=1e-3))
               for b, at in enumerate(feeds["seqlens_k"])]
    return {"max_abs_error": float(np.abs(output - expected).max()), "new_column_written": written,
            "present_shape": list(present_key.shape), "rows_max_abs_error":
            [float(np.abs(output[b] - expected[b]).max()) for b in range(output.shape[0])]}


def check() -> dict[str, Any]:
    """Every case on every available provider (CUDA first)."""
    graph = gqa_graph()
    report: dict[str, Any] = {"onnxruntime": ort.__version__, "providers": {}}
    for provider, device in (("CUDAExecutionProvider", "cuda"), ("CPUExecutionProvider", "cpu")):
        if provider not in ort.get_available_providers():
            continue
        session = ort.InferenceSession(graph, providers=[provider])
        results = {}
        for name, feeds in cases(np.random.default_rng(0)).items():
            for shared in (True, False):
                results[f"{name}, {'in place' if shared else 'fresh present'}"] = run_case(session, device, feeds, shared)
        report["providers"][provider] = results
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gqa_cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default: print only)")
    args = parser.parse_args(argv)
    emit_json(check(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
