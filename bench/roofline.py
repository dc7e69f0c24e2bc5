"""The roofline line of the report: the work a translation costs in FLOPs, the matrix-multiply
peak this machine reaches with onnxruntime's kernels at the model's shapes, and the fraction of
that ceiling a measured throughput uses.

FLOPs count the matrix multiplications (2 per multiply-add) of the encoder, the decoder steps
and the attention scores and weighted sums; layer norms, softmax and the activations are left
out (a few % of the total). The peak is the best GFLOP/s of a single `MatMulInteger` (int8: uint8
activations, int8 weights, the kernel the int8 graphs run) or `MatMul` (fp32) graph, over the
shapes a running batch multiplies (`GEMM_SHAPES`), with onnxruntime's default threads.

`python -m bench.roofline --levers DIR` puts a `bench.levers` run on that line: the FLOPs of its
workload's sentences at the run's mean output length, the peak measured now (right after the
run, on the same machine state), each variant's and CTranslate2's share of it; it writes
`DIR/roofline.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROWS = 64  # the rows of a full running batch (max_batch_size)


@dataclass(frozen=True)
class Shapes:
    """The sizes FLOPs depend on (a `ModelConfig`'s fields of the same names)."""

    vocab_size: int
    d_model: int
    n_encoder_layers: int
    n_decoder_layers: int
    d_ff: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Shapes:
        return cls(**{name: int(config[name]) for name in cls.__dataclass_fields__})


def encoder_flops(shapes: Shapes, source_len: int) -> float:
    """One source of `source_len` tokens through the encoder, and its cross-attention keys and
    values projected for every decoder layer."""
    d, s = shapes.d_model, source_len
    per_layer = s * (4 * d * d + 2 * d * shapes.d_ff) + 2 * s * s * d  # projections + FFN, scores + sum
    cross_kv = shapes.n_decoder_layers * s * 2 * d * d
    return 2.0 * (shapes.n_encoder_layers * per_layer + cross_kv)


def decoder_step_flops(shapes: Shapes, position: int, source_len: int) -> float:
    """One decoder step of one row at `position` (its cached length), over `source_len` source tokens."""
    d = shapes.d_model
    projections = 6 * d * d + 2 * d * shapes.d_ff  # self q/k/v/out, cross q/out, FFN
    attention = 2 * (position + 1) * d + 2 * source_len * d  # self and cross: scores + weighted sum
    return 2.0 * (shapes.n_decoder_layers * (projections + attention) + d * shapes.vocab_size)


def sentence_flops(shapes: Shapes, source_len: int, target_len: int) -> float:
    """A whole greedy translation: the encoder, then one step per target token and one for EOS."""
    steps = sum(decoder_step_flops(shapes, position, source_len) for position in range(target_len + 1))
    return encoder_flops(shapes, source_len) + steps


def workload_flops(shapes: Shapes, source_lens: Sequence[int], target_lens: Sequence[int]) -> float:
    """Mean FLOPs per sentence of a workload (source lengths include EOS)."""
    if len(source_lens) != len(target_lens) or not source_lens:
        raise ValueError("one target length per source, at least one")
    return float(np.mean([sentence_flops(shapes, s, t) for s, t in zip(source_lens, target_lens, strict=True)]))


def gemm_shapes(shapes: Shapes, rows: int = ROWS) -> list[tuple[int, int, int]]:
    """(M, K, N) of the decoder step's multiplications for `rows` rows: the attention projections,
    the two FFN layers and the output projection."""
    d = shapes.d_model
    return [(rows, d, d), (rows, d, 3 * d), (rows, d, shapes.d_ff), (rows, shapes.d_ff, d),
            (rows, d, shapes.vocab_size)]


def _gemm_session(m: int, k: int, n: int, int8: bool, threads: int) -> tuple[Any, dict[str, np.ndarray]]:
    """An onnxruntime session of one multiplication `A (m, k) x B (k, n)`, B a constant, and its feed."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    if int8:
        a = rng.integers(0, 255, size=(m, k), dtype=np.uint8)
        b = rng.integers(-127, 127, size=(k, n), dtype=np.int8)
        node = helper.make_node("MatMulInteger", ["A", "B"], ["Y"])
        a_type, y_type = TensorProto.UINT8, TensorProto.INT32
    else:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        node = helper.make_node("MatMul", ["A", "B"], ["Y"])
        a_type, y_type = TensorProto.FLOAT, TensorProto.FLOAT
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("A", a_type, [m, k])],
                              [helper.make_tensor_value_info("Y", y_type, [m, n])],
                              initializer=[numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(onnx.shape_inference.infer_shapes(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session, {"A": a}


def gemm_gflops(m: int, k: int, n: int, int8: bool, threads: int = 0, seconds: float = 0.5) -> float:
    """GFLOP/s of repeated `A (m, k) x B (k, n)` calls for about `seconds` (after a warm-up)."""
    session, feed = _gemm_session(m, k, n, int8, threads)
    for _ in range(3):
        session.run(None, feed)
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        session.run(None, feed)
        calls += 1
    return 2.0 * m * k * n * calls / elapsed / 1e9


def peaks(shapes: Shapes, threads: int = 0, seconds: float = 0.5) -> dict[str, Any]:
    """The int8 and fp32 GFLOP/s of every shape of `gemm_shapes` and the best of each: the ceiling."""
    result: dict[str, Any] = {}
    for name, int8 in (("int8", True), ("fp32", False)):
        points = [{"m": m, "k": k, "n": n, "gflops": round(gemm_gflops(m, k, n, int8, threads, seconds), 2)}
                  for m, k, n in gemm_shapes(shapes)]
        result[name] = {"points": points, "peak_gflops": max(p["gflops"] for p in points)}
    return result


def fraction(sentences_per_s: float | None, flops_per_sentence: float, peak_gflops: float) -> float | None:
    """The share of the ceiling a throughput uses: sentences/s x FLOPs per sentence / peak."""
    if sentences_per_s is None or peak_gflops <= 0:
        return None
    return sentences_per_s * flops_per_sentence / (peak_gflops * 1e9)


def levers_fractions(levers: dict[str, Any], shapes: Shapes, source_lens: Sequence[int], peak_gflops: float,
                     variant: str = "defaults (continuous batching)") -> dict[str, Any]:
    """A `bench.levers` result (`levers.json`) on the roofline: the FLOPs of sentences of
    `source_lens` at `variant`'s mean output length, and each variant's (and CTranslate2's,
    when the run has it) share of `peak_gflops`."""
    run = levers["variants"][variant]
    target_len = round(run["target_tokens"] / run["sentences"])
    flops = workload_flops(shapes, source_lens, [target_len] * len(source_lens))
    rates = {name: v["sentences_per_s"] for name, v in levers["variants"].items()}
    if levers.get("ctranslate2"):
        rates["CTranslate2"] = levers["ctranslate2"]["sentences_per_s"]
    return {"int8_peak_gflops": peak_gflops, "flops_per_sentence": flops, "mean_target_tokens": target_len,
            "fraction_int8": {name: _rounded(fraction(rate, flops, peak_gflops)) for name, rate in rates.items()}}


def _rounded(share: float | None) -> float | None:
    return None if share is None else round(share, 4)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.roofline --levers DIR`: the module's docstring."""
    parser = argparse.ArgumentParser(prog="python -m bench.roofline", description=main.__doc__)
    parser.add_argument("--levers", type=Path, required=True, help="a `bench.levers --out` folder (its levers.json)")
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--variant", default="defaults (continuous batching)",
                        help="the variant whose mean output length the FLOPs take")
    parser.add_argument("--seconds", type=float, default=0.5, help="per GEMM shape, measuring the peak")
    args = parser.parse_args(argv)
    from bench import workload
    from model.tokenizer import Tokenizer
    from service.repository.manifest import read_manifest

    levers = json.loads((args.levers / "levers.json").read_text(encoding="utf-8"))
    manifest = read_manifest(args.model)
    shapes = Shapes.from_config(manifest.model_config)
    work = workload.load(args.data_dir, args.model.name, manifest.task, Tokenizer.from_file(args.model / "tokenizer.model"),
                         manifest.max_source_len, levers["sentences"], levers.get("split", "test"))
    peak = peaks(shapes, seconds=args.seconds)["int8"]["peak_gflops"]
    result = levers_fractions(levers, shapes, [len(ids) for ids in work.source_ids], peak, args.variant)
    (args.levers / "roofline.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
