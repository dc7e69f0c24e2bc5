"""The step graph with an int8 cache (`export.kv_cache`) and `attnserve add-int8-cache`, on the
tiny model: the graph's cache and cross keys/values become int8, the running batch decodes
with it, its slot buffers take a quarter of the bytes, and the command records the quality it
measured or refuses and leaves the repository as it was."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from export import kv_cache
from export.kv_cache import (
    QualityDrop,
    add_int8_cache,
    calibrate,
    has_int8_cache,
    int8_cache_graph,
    last_source_inputs,
)
from export.repository import update_step_graphs
from service.batching.slot_batch import SlotBatch, generate_running
from service.repository import graph_io
from service.repository.manifest import read_manifest, verify_files
from service.runtime import CPU, ModelRuntime, to_numpy
from service.runtime.step_buffers import HostSlots, cross_scales, run_step


def _sources(runtime: ModelRuntime, data: Path) -> list[list[int]]:
    texts = (data / "test.src").read_text(encoding="utf-8").splitlines()
    return [ids + [runtime.eos_id] for ids in runtime.tokenizer.encode_batch(texts)]


def test_the_rewritten_graph_takes_int8_and_lists_the_cross_scales(tiny_repository_and_data: tuple[Path, Path]) -> None:
    directory, data = tiny_repository_and_data
    runtime = ModelRuntime.load(directory, [CPU], threads=1, variant="int8", step_graph=True)
    scales = calibrate(runtime, _sources(runtime, data)[:8])
    layers = runtime.n_decoder_layers
    assert len(scales.self_attention) == len(scales.cross_attention) == layers
    assert all(0 < scale < 1 for pair in [*scales.self_attention, *scales.cross_attention] for scale in pair)
    step_file = directory / read_manifest(directory).variants["int8"].step_decoder
    original = onnx.load_model(str(step_file), load_external_data=False)
    graph = int8_cache_graph(original, scales)
    assert not has_int8_cache(original) and has_int8_cache(graph)
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.graph.input, *graph.graph.output]}
    for i in range(layers):
        for name in (f"past_key.{i}", f"cross_value.{i}", f"present_value.{i}", f"present_cross_key.{i}"):
            assert types[name] == TensorProto.INT8, name
    assert types["logits"] == TensorProto.FLOAT
    listed = json.loads({p.key: p.value for p in graph.metadata_props}[graph_io.CROSS_SCALES])
    assert listed == pytest.approx([s for pair in scales.cross_attention for s in pair])
    attention = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 2 * layers and all(len(n.input) == 14 for n in attention)
    # each row's last source position and the cross keys/values there are inputs, not the source mask
    inputs = {v.name: v for v in graph.graph.input}
    assert "source_mask" not in inputs and types[graph_io.SOURCE_LAST] == TensorProto.INT32
    width = runtime.n_heads * runtime.head_dim
    for name in graph_io.cross_last_names(layers):
        assert [d.dim_value or d.dim_param for d in inputs[name].type.tensor_type.shape.dim] == ["batch", 1, width]
    cross = [n for n in attention if n.input[3].startswith("cross_key.")]
    assert [(n.input[1], n.input[2], n.input[5]) for n in cross] == [
        (f"cross_last_key.{i}", f"cross_last_value.{i}", graph_io.SOURCE_LAST) for i in range(layers)]
    assert not any(n.op_type in ("ReduceSum", "Range", "Expand") for n in graph.graph.node)  # the per-step gathers are gone
    assert last_source_inputs(graph) == 0  # has them already
    assert last_source_inputs(original) == 0  # no int8 cache: the gather reads float columns


def test_an_int8_graph_without_the_last_source_inputs_is_updated_to_the_same_tokens(
        tiny_repository_and_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A repository whose int8 step graph gathers each row's last source column itself (as
    graphs made before `last_source_inputs` do): `update_step_graphs` gives it the inputs (it
    checks the outputs stay exactly the same on random inputs), and a running batch whose rows
    join, leave and move between slots, and rows decoding alone, give the same tokens as before."""
    directory, data = tiny_repository_and_data
    with monkeypatch.context() as patch:
        patch.setattr(kv_cache, "last_source_inputs", lambda graph: 0)
        assert add_int8_cache(directory, data, calibration_rows=50, threads=1) is not None
    before = ModelRuntime.load(directory, [CPU], threads=1, variant="int8", step_graph=True)
    assert before.step is not None and "source_mask" in {i.name for i in before.step.get_inputs()}
    sources = _sources(before, data)
    expected = {rows: dict(generate_running(before, list(enumerate(sources)), rows=rows)) for rows in (1, 4)}
    assert update_step_graphs(directory) == [read_manifest(directory).variants["int8"].step_decoder]
    after = ModelRuntime.load(directory, [CPU], threads=1, variant="int8", step_graph=True)
    assert after.step is not None and graph_io.SOURCE_LAST in {i.name for i in after.step.get_inputs()}
    for rows, tokens in expected.items():
        actual = dict(generate_running(after, list(enumerate(sources)), rows=rows))
        assert all(actual[i].tokens == tokens[i].tokens for i in tokens), rows
    assert update_step_graphs(directory) == []


def test_add_int8_cache_records_its_quality_and_quarters_the_slot_buffers(tiny_repository_and_data: tuple[Path, Path]) -> None:
    directory, data = tiny_repository_and_data
    before = ModelRuntime.load(directory, [CPU], threads=1, variant="int8", step_graph=True)
    sources = _sources(before, data)
    expected = dict(generate_running(before, list(enumerate(sources)), rows=8))
    record = add_int8_cache(directory, data, calibration_rows=50, threads=1)
    assert record is not None and record["graphs"] == [read_manifest(directory).variants["int8"].step_decoder]
    manifest = read_manifest(directory)
    verify_files(directory, manifest)  # the new graphs' sha256s are listed
    assert manifest.exporter["int8_cache"] == record
    quality = record["quality"]
    assert quality["rows"] == len(sources) and quality["int8_cache"]["bleu"] >= quality["float_cache"]["bleu"] - 0.1
    after = ModelRuntime.load(directory, [CPU], threads=1, variant="int8", step_graph=True)
    assert after.step is not None and {i.name: i.type for i in after.step.get_inputs()}["cross_key.0"] == "tensor(int8)"
    actual = dict(generate_running(after, list(enumerate(sources)), rows=8))
    same = sum(actual[i].tokens == expected[i].tokens for i in expected)
    assert same >= 0.9 * len(sources) and quality["rows_with_other_tokens"] <= 0.1 * len(sources)
    float_batch, int8_batch = SlotBatch(before), SlotBatch(after)
    for batch in (float_batch, int8_batch):
        batch.concatenate(sources[:4], [0, 1, 2, 3], [8] * 4)
    assert int8_batch.cache_bytes * 4 == float_batch.cache_bytes
    with pytest.raises(ValueError, match="host slots only"):
        SlotBatch(after, on_device=True)  # device slots would write newcomers unquantized
    assert add_int8_cache(directory, data, calibration_rows=50, threads=1) is None  # present already


def test_a_quality_drop_over_the_bound_leaves_the_repository_as_it_was(tiny_repository_and_data: tuple[Path, Path]) -> None:
    directory, data = tiny_repository_and_data
    files = {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()}
    with pytest.raises(QualityDrop, match="^bleu "):
        add_int8_cache(directory, data, calibration_rows=50, max_drop=-100.0, threads=1)  # any result is a drop
    assert {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()} == files


def test_a_summarizer_is_held_to_every_rouge_score(tiny_repository_and_data: tuple[Path, Path]) -> None:
    """The tiny reversal model as a summarizer: its record has ROUGE scores, and a drop bound no
    score can meet names the first ROUGE measure."""
    directory, data = tiny_repository_and_data
    manifest_file = directory / "manifest.json"
    values = json.loads(manifest_file.read_text(encoding="utf-8"))
    values["task"] = "summarize"
    manifest_file.write_text(json.dumps(values), encoding="utf-8")
    with pytest.raises(QualityDrop, match="^rouge1 "):
        add_int8_cache(directory, data, calibration_rows=50, max_drop=-100.0, threads=1)
    record = add_int8_cache(directory, data, calibration_rows=50, max_drop=100.0, threads=1)
    assert record is not None and set(record["quality"]["int8_cache"]) == {"rouge1", "rouge2", "rougeL"}


def test_host_slots_keep_each_rows_last_source_position_through_joins_and_moves(
        tiny_repository_and_data: tuple[Path, Path]) -> None:
    """`HostSlots.step` on a graph that takes each row's last source position keeps it beside
    the slots: every step, after rows are written, moved into a hole and written again, equals
    `run_step` over a copy of the same buffers, which works it out afresh."""
    directory, data = tiny_repository_and_data
    assert add_int8_cache(directory, data, calibration_rows=50, threads=1) is not None
    runtime = ModelRuntime.load(directory, [CPU], threads=1, variant="int8", step_graph=True)
    step = runtime.step
    assert step is not None and graph_io.SOURCE_LAST in {i.name for i in step.get_inputs()}
    sources = sorted(_sources(runtime, data), key=len)
    groups = [sources[:1], sources[-2:], sources[len(sources) // 2:len(sources) // 2 + 1]]  # short, long, middle
    states = [runtime.encode(runtime.pad(group)) for group in groups]
    width = max(state.source_mask.shape[1] for state in states)
    layers, heads, head_dim = runtime.n_decoder_layers, runtime.n_heads, runtime.head_dim
    made = [HostSlots(layers, 4, heads, 8, head_dim, width, np.int8, np.int8, cross_scales(step)) for _ in range(2)]
    mask = np.zeros((4, width), dtype=bool)

    def write(row: int, index: int) -> None:
        state = states[index]
        cross = [t for pair in zip(state.cross_keys, state.cross_values, strict=True) for t in pair]
        count, w = state.source_mask.shape
        for slots in made:
            slots.write(row, cross)
        mask[row:row + count] = False
        mask[row:row + count, :w] = to_numpy(state.source_mask)

    kept, fresh = made
    ids = np.full((4, 1), runtime.decoder_start_id, dtype=np.int64)
    for position, count, change in ((0, 1, lambda: write(0, 0)), (1, 3, lambda: write(1, 1)), (2, 3, None),
                                    (3, 2, "move"), (4, 3, lambda: write(2, 2)), (5, 3, None)):
        if change == "move":  # row 0 leaves: the last row moves into its hole
            for slots in made:
                slots.move_rows(np.array([2]), np.array([0]), position)
            mask[0] = mask[2]
        elif change is not None:
            change()
        positions = np.full((count, 1), position, dtype=np.int64)
        logits = kept.step(step, ids[:count], positions, mask[:count])
        expected = run_step(step, ids[:count], positions, mask[:count], [c[:count] for c in fresh.cross], fresh.buffers)
        np.testing.assert_array_equal(logits, expected)
