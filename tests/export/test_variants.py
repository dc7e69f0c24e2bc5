"""int8 conversion: the tied output projection gets its own transposed weight, so it is quantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from export.storage import load_graph
from export.variants import untie_transposed_weights


def _tied_graph(extra_reader: bool) -> onnx.ModelProto:
    """y = x @ W.T with W (5, 3) also read by a Gather (as a tied embedding is); optionally the
    Transpose's output is also a graph output."""
    weight = np.arange(15, dtype=np.float32).reshape(5, 3) / 10
    nodes = [
        helper.make_node("Transpose", ["W"], ["W_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "W_t"], ["y"]),
        helper.make_node("Gather", ["W", "ids"], ["embedded"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5]),
               helper.make_tensor_value_info("embedded", TensorProto.FLOAT, [2, 3])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("W_t", TensorProto.FLOAT, [3, 5]))
    graph = helper.make_graph(
        nodes, "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        outputs, initializer=[numpy_helper.from_array(weight, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(graph: onnx.ModelProto) -> list[np.ndarray]:
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), "ids": np.array([4, 0])}
    return session.run(None, feeds)


def test_untied_matmul_reads_a_transposed_initializer_and_computes_the_same() -> None:
    tied = _tied_graph(extra_reader=False)
    untied = untie_transposed_weights(tied)
    assert [n.op_type for n in untied.graph.node] == ["MatMul", "Gather"]
    matmul = untied.graph.node[0]
    weights = {t.name: numpy_helper.to_array(t) for t in untied.graph.initializer}
    assert weights[matmul.input[1]].shape == (3, 5) and "W" in weights  # the Gather keeps the original
    for before, after in zip(_run(tied), _run(untied)):
        np.testing.assert_array_equal(before, after)
    assert tied.graph.node[0].op_type == "Transpose"  # the input graph is left as it was


def test_a_transpose_with_other_readers_is_kept() -> None:
    untied = untie_transposed_weights(_tied_graph(extra_reader=True))
    assert [n.op_type for n in untied.graph.node] == ["Transpose", "MatMul", "Gather"]
    assert untied.graph.node[1].input[1] == "W.transposed"


def test_int8_decoder_quantizes_the_output_projection(tiny_model_repository: Path) -> None:
    """No float MatMul of the int8 decoder has a weight initializer behind it: the logits come
    from an integer MatMul (only attention's activation x activation MatMuls stay float)."""
    graph = load_graph(tiny_model_repository / "int8" / "decoder.onnx").graph
    producers = {out: node for node in graph.node for out in node.output}
    constant = {t.name for t in graph.initializer}

    def reads_a_constant(name: str) -> bool:
        node = producers.get(name)
        return name in constant or (node is not None and node.op_type in {"Transpose", "DequantizeLinear"}
                                    and all(reads_a_constant(i) for i in node.input if i))

    float_weight_matmuls = [n.name for n in graph.node if n.op_type == "MatMul" and reads_a_constant(n.input[1])]
    assert float_weight_matmuls == []
    seen, pending = set(), ["logits"]
    while pending:  # walk back from the logits to the first matrix product
        node = producers[pending.pop(0)]  # breadth first: the nearest product
        if node.op_type in {"MatMul", "MatMulInteger"}:
            assert node.op_type == "MatMulInteger"
            break
        seen.add(node.name)
        pending.extend(i for i in node.input if i in producers)
    else:
        raise AssertionError("no matrix product behind the logits")
