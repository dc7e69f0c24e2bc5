"""`bench.weight_only`: the fp32 graphs become weight-only int8 graphs onnxruntime runs."""

from __future__ import annotations

import dataclasses

import onnx
import onnxruntime as ort

from bench.weight_only import quantize, time_variant
from service.runtime import CPU, ModelRuntime


def test_the_fp32_graphs_become_matmulnbits_graphs_that_decode(tiny_model_repository, tmp_path) -> None:
    paths = quantize(tiny_model_repository, tmp_path)
    for path in paths.values():
        ops = [node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node]
        assert "MatMulNBits" in ops
    runtime = ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="fp32")
    sessions = {name: ort.InferenceSession(str(path), providers=[CPU]) for name, path in paths.items()}
    weight_only = dataclasses.replace(runtime, encoder=sessions["encoder"], step=sessions["decoder_step"])
    sources = [[5, 6, 7, 3], [8, 9, 10, 11, 3], [4, 3]]
    timing, outputs = time_variant(weight_only, sources, alone=3, rows=2)
    _, reference = time_variant(runtime, sources, alone=3, rows=2)
    assert timing["alone_p50_s"] > 0 and timing["batch_sentences_per_s"] > 0
    assert sum(a == b for a, b in zip(outputs, reference, strict=True)) >= 2  # 8-bit weights: nearly fp32's tokens
