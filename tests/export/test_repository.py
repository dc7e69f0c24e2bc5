"""What the exported model repository holds (and does not)."""

from __future__ import annotations

from pathlib import Path


def test_saved_graphs_hold_no_export_stack_traces(tiny_model_repository: Path) -> None:
    """The exporter's per-node Python stacks (source paths of the exporting machine) are dropped."""
    import onnx

    graphs = sorted(tiny_model_repository.rglob("*.onnx"))
    assert len(graphs) >= 4
    for path in graphs:
        graph = onnx.load(str(path), load_external_data=False)
        keys = {p.key for node in graph.graph.node for p in node.metadata_props}
        assert "pkg.torch.onnx.stack_trace" not in keys, path
