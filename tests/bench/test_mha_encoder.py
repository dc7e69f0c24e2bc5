"""The encoder exported with onnxruntime's MultiHeadAttention computes the repository encoder's
cross keys/values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench.mha_encoder import call_ms, export_mha_encoder
from model.checkpoint import load_model
from service.repository import graph_io


def test_the_mha_encoder_gives_the_repository_encoders_cross_keys_and_values(tiny_model_repository: Path) -> None:
    model = load_model(tiny_model_repository)
    graph = export_mha_encoder(model)
    kinds = {node.op_type for node in graph.graph.node}
    assert "MultiHeadAttention" in kinds and "Softmax" not in kinds
    names = graph_io.cross_names(model.config.n_decoder_layers)
    mha = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    shipped = ort.InferenceSession(str(tiny_model_repository / "encoder.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[5, 6, 7, 8, 9, 3], [10, 11, 3, 0, 0, 0], [12, 3, 0, 0, 0, 0]], dtype=np.int64)
    real = (ids != 0)[:, None, :, None]  # (B, 1, S, 1): the positions a decoder reads
    for ours, theirs in zip(mha.run(names, {"input_ids": ids}), shipped.run(names, {"input_ids": ids}), strict=True):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(np.where(real, ours, 0), np.where(real, theirs, 0), atol=1e-4)
    assert call_ms(mha, names, (2, 5), model.config.vocab_size, calls=3) > 0
