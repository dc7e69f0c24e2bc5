"""`bench.step_graph_parity` and `bench.gqa_cuda` on the CPU: the tools that locate a step graph's
departure on a provider, and the GroupQueryAttention semantics the step graph relies on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench import gqa_cuda, step_graph_parity
from export.storage import load_graph
from service.runtime import CPU, ModelRuntime

EOS = 2


def test_the_cpu_kernel_computes_the_reference_in_every_way_the_step_graph_calls_it() -> None:
    """Self-attention at mixed, equal and zero lengths and cross-attention over each row's own
    source, in place and not: the numpy reference (what the step graph assumes) is the kernel's."""
    cases = gqa_cuda.check()["providers"][CPU]
    assert len(cases) == 8
    for name, case in cases.items():
        assert "error" not in case, name
        assert case["max_abs_error"] < 5e-3, (name, case["max_abs_error"])
        assert all(case["new_column_written"]), name


def test_the_capacity_total_computes_what_the_longest_rows_total_computes(tiny_model_repository: Path,
                                                                          trained_tiny) -> None:
    """The step graph gives self-attention the cache's capacity as total_sequence_length (a shape,
    so onnxruntime reads it on the host); fed instead the longest row's length after the step
    (and cross-attention the source width), every output is the same, at rows of mixed positions."""
    runtime = ModelRuntime.load(tiny_model_repository, [CPU], variant="fp32", step_graph=True)
    sources = [s + [EOS] for s in trained_tiny.valid.sources[:5]]
    feeds = step_graph_parity.first_step_feeds(runtime, sources, capacity=9, dtype=np.float32)
    rng = np.random.default_rng(0)
    feeds["positions"] = np.array([[0], [3], [1], [8], [5]], np.int64)
    feeds["total.self"] = np.array(9, np.int32)  # the longest row: position 8, then its new one
    for name in feeds:
        if name.startswith("past_"):
            feeds[name] = rng.standard_normal(feeds[name].shape).astype(np.float32)
    graph = load_graph(tiny_model_repository / runtime.manifest.variants["fp32"].step_decoder)
    own = ort.InferenceSession(graph.SerializeToString(), providers=[CPU])
    assert {i.name for i in own.get_inputs()}.isdisjoint({"total.self", "total.cross"})
    added = step_graph_parity.feed_totals_from_host(graph)
    fed = ort.InferenceSession(graph.SerializeToString(), providers=[CPU])
    assert sorted(added) == ["total.cross", "total.self"]
    outputs = [session.run(None, {k: v.copy() for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}})
               for session in (own, fed)]
    for a, b in zip(*outputs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    feeds["total.self"] = np.array(1, np.int32)  # too short a total: rows past it read less
    wrong = fed.run(None, {k: v for k, v in feeds.items() if k in {i.name for i in fed.get_inputs()}})[0]
    assert not np.allclose(wrong, outputs[0][0], atol=1e-3)


def test_the_parity_report_of_the_cpu_against_itself_is_empty(tiny_model_repository: Path, trained_tiny) -> None:
    sources = [s + [EOS] for s in trained_tiny.valid.sources[:4]]
    report = step_graph_parity.compare(tiny_model_repository, "fp32", CPU, sources=sources, capacity=6)
    assert report["departing_nodes"] == 0 and report["same_next_token"] == 4 and report["logits_max_abs_diff"] == 0.0
    assert report["nodes"] > 20
    fed = step_graph_parity.compare(tiny_model_repository, "fp32", CPU, host_totals=True, sources=sources, capacity=6)
    assert fed["host_totals"] and fed["departing_nodes"] == 0
