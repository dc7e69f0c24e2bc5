"""Weight storage: the fp32 variant's weights stored as bfloat16 in standard ONNX external data,
the same float32 values, half the bytes, loadable by plain onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from export.storage import (
    WEIGHTS_FILE,
    NotBfloat16,
    add_graphs,
    load_graph,
    save_graphs,
    store_as_bfloat16,
)
from model.checkpoint import load_model
from service.repository.manifest import read_manifest


def test_every_graph_of_the_repository_loads_with_plain_onnxruntime(tiny_model_repository: Path) -> None:
    graphs = sorted(tiny_model_repository.rglob("*.onnx"))
    assert len(graphs) == 6  # fp32 and int8: encoder, decoder, step graph
    for path in graphs:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_fp32_weights_are_the_checkpoints_at_half_the_bytes(tiny_model_repository: Path) -> None:
    """The float32 weights the graph computes with are exactly the checkpoint's (bfloat16 numbers)."""
    stored = onnx.load_model(str(tiny_model_repository / "encoder.onnx"), load_external_data=False)
    kinds = {t.data_type for t in stored.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert kinds == {onnx.TensorProto.BFLOAT16}
    restored = {t.name: numpy_helper.to_array(t) for t in load_graph(tiny_model_repository / "encoder.onnx").graph.initializer}
    state = load_model(tiny_model_repository).state_dict()
    embedding = state["source_embedding.tokens.weight"].numpy()
    assert any(a.dtype == np.float32 and a.shape == embedding.shape and np.array_equal(a, embedding)
               for a in restored.values())
    float32_bytes = sum(a.nbytes for a in restored.values() if a.dtype == np.float32 and a.nbytes >= 1024)
    assert (tiny_model_repository / WEIGHTS_FILE).stat().st_size < 0.55 * float32_bytes * 2  # tied matrix once


def _graph(weight: np.ndarray) -> onnx.ModelProto:
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 32])],
                              [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_store_and_load_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((16, 32)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    save_graphs(tmp_path, {"g.onnx": _graph(weight)}, bfloat16_weights=True)
    assert (tmp_path / WEIGHTS_FILE).stat().st_size == weight.nbytes // 2
    x = rng.standard_normal((1, 16)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "g.onnx"), providers=["CPUExecutionProvider"])
    # the graph computes with the stored weights (kernels may sum in another order than numpy)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ weight, rtol=1e-5, atol=1e-5)
    (restored,) = load_graph(tmp_path / "g.onnx").graph.initializer
    assert restored.name == "w" and np.array_equal(numpy_helper.to_array(restored), weight)


def test_added_graphs_read_the_weights_already_stored_and_append_only_new_ones(tmp_path: Path) -> None:
    """`add_graphs` beside a saved graph: an fp16 graph of the same (bfloat16) weights adds no
    byte to weights.bin; a graph with a new weight appends it, and the first graph still loads
    its own weights from the offsets it had."""
    from export.variants import to_fp16

    rng = np.random.default_rng(0)

    def bfloat16_numbers(shape: tuple[int, ...]) -> np.ndarray:
        return (rng.standard_normal(shape).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)

    weight, other = bfloat16_numbers((16, 32)), bfloat16_numbers((16, 32))
    save_graphs(tmp_path, {"g.onnx": _graph(weight)}, bfloat16_weights=True)
    first = (tmp_path / "g.onnx").read_bytes()
    stored = (tmp_path / WEIGHTS_FILE).read_bytes()
    written = add_graphs(tmp_path, {"g.fp16.onnx": to_fp16(_graph(weight))}, bfloat16_weights=True,
                         converted_from={"g.fp16.onnx": _graph(weight)})
    assert written == [tmp_path / "g.fp16.onnx"] and (tmp_path / WEIGHTS_FILE).read_bytes() == stored
    written = add_graphs(tmp_path, {"h.onnx": _graph(other)}, bfloat16_weights=True)
    assert written == [tmp_path / WEIGHTS_FILE, tmp_path / "h.onnx"]
    grown = (tmp_path / WEIGHTS_FILE).read_bytes()
    assert grown.startswith(stored) and len(grown) == len(stored) + other.nbytes // 2
    assert (tmp_path / "g.onnx").read_bytes() == first
    x = rng.standard_normal((1, 16)).astype(np.float32)
    for name, expected, tolerance in (("g.onnx", weight, 1e-5), ("g.fp16.onnx", weight, 5e-2), ("h.onnx", other, 1e-5)):
        session = ort.InferenceSession(str(tmp_path / name), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ expected, rtol=tolerance, atol=tolerance)


def test_a_weight_that_is_not_bfloat16_is_refused() -> None:
    weight = np.full((16, 32), 1.0 + 2**-20, np.float32)
    with pytest.raises(NotBfloat16, match="w: values that are not bfloat16 numbers"):
        store_as_bfloat16(_graph(weight))


def test_fp16_graphs_share_the_fp32_weights(tiny_fp16_repository: Path, tiny_model_repository: Path) -> None:
    """The fp16 variant's graphs cast the same bfloat16 weights to float16: the repository grows
    by its graph files only, and it decodes what fp32 decodes."""
    from service.generation.search import generate
    from service.runtime import CPU, ModelRuntime

    out = tiny_fp16_repository
    fp16 = read_manifest(out).variants["fp16"]
    assert (fp16.encoder, fp16.decoder, fp16.step_decoder) == ("encoder.fp16.onnx", "decoder.fp16.onnx",
                                                              "decoder_step.fp16.onnx")
    assert (out / WEIGHTS_FILE).stat().st_size == (tiny_model_repository / WEIGHTS_FILE).stat().st_size
    for name in (fp16.encoder, fp16.decoder, fp16.step_decoder):
        graph = onnx.load_model(str(out / name), load_external_data=False)
        assert any(n.op_type == "Cast" and n.input[0].endswith(".bf16") for n in graph.graph.node)
        ort.InferenceSession(str(out / name), providers=["CPUExecutionProvider"])
    sources = [[5, 6, 7, 3], [9, 8, 3], [4, 10, 11, 12, 13, 3]]
    tokens = {v: [r.tokens for r in generate(ModelRuntime.load(out, [CPU], threads=1, variant=v), sources, 1, 12)]
              for v in ("fp32", "fp16")}
    assert tokens["fp16"] == tokens["fp32"]


def test_every_committed_graph_loads_with_plain_onnxruntime() -> None:
    """What Netron, Triton's onnxruntime backend or a plain script would do with models/."""
    models = Path(__file__).resolve().parents[2] / "models"
    graphs = sorted(models.rglob("*.onnx"))
    assert len(graphs) >= 12
    for path in graphs:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
