"""`bench.static_step`: a lone row on the step graph with its dimensions fixed decodes as the
runtime's own session does (on the CPU, the same tokens and logits within float rounding), and the CUDA graph says why not here."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import onnx

from bench import static_step
from export.storage import load_graph
from service.generation.search import generate
from service.repository.manifest import read_manifest
from service.runtime import CPU, ModelRuntime
from service.runtime.lone_slots import LoneSlots, fixed_dimensions


def test_a_lone_row_with_fixed_shapes_decodes_as_the_dynamic_session(tiny_model_repository: Path,
                                                                     tiny_runtime: ModelRuntime) -> None:
    session = static_step.static_session(tiny_model_repository, tiny_runtime)
    fixed = {i.name: i.shape for i in session.get_inputs()}
    assert (fixed["positions"], fixed["source_mask"], fixed["past_key.0"][2]) == \
        ([1, 1], [1, tiny_runtime.max_source_len], tiny_runtime.max_target_len)
    fixed = fixed_dimensions(tiny_runtime.max_target_len, tiny_runtime.max_source_len)
    assert fixed == {"batch": 1, "capacity": tiny_runtime.max_target_len, "source_len": tiny_runtime.max_source_len}
    sources = [tiny_runtime.tokenizer.encode(text) + [tiny_runtime.eos_id] for text in ("abc de", "fg hij", "k")]
    tokens, logits, seconds = static_step.decode(LoneSlots.of(tiny_runtime, session), tiny_runtime,
                                                 sources[0], 16)
    assert tokens == generate(tiny_runtime, sources[:1], 1, 16)[0].tokens  # request-level greedy's tokens
    assert tiny_runtime.tokenizer.decode(tokens).strip() == "ed cba"  # the tiny model reverses its input
    assert len(logits) == len(tokens) + 1 and seconds > 0  # the last step chose EOS
    report = static_step.measure(tiny_model_repository, tiny_runtime, sources, 16)
    assert report["sentences"] == 3 and report["fixed_dimensions"] == fixed
    assert report["dynamic"]["steps"] == report["static"]["steps"] > len(sources)
    assert report["static"]["same_tokens"] == 1.0 and report["static"]["max_logit_difference"] < 1e-5
    assert report["dynamic"]["ms_per_step"] > 0 and report["static"]["ms_per_step"] > 0
    assert report["cuda_graph"] == {"error": f"CUDA graphs need the CUDA provider (this runtime is on {CPU})"}


def test_the_command_writes_its_report(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    models, data = tiny_bench_dirs
    out = tmp_path / "static.json"
    assert static_step.main(["--model", str(models / "tiny-reverse"), "--data-dir", str(data),
                             "--sentences", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python -m bench.static_step --model ")
    assert report["provider"] == CPU and report["sentences"] == 4 and report["static"]["same_tokens"] == 1.0


def test_a_variant_without_a_step_graph_says_so(tiny_runtime: ModelRuntime, tiny_model_repository: Path,
                                                monkeypatch) -> None:
    monkeypatch.setattr(tiny_runtime, "step", None)
    assert static_step.measure(tiny_model_repository, tiny_runtime, [[3]]) == {"error": "the variant has no step graph"}


def test_the_step_graph_rewrites_decode_the_same_tokens(tiny_model_repository: Path,
                                                        tiny_runtime: ModelRuntime) -> None:
    """Each rewrite of the step graph (`GRAPH_VARIANTS`) is measured the fixed-shape way (on the
    CPU, `static`), in a graph of fewer nodes, and decodes the dynamic session's tokens, its logits
    within float rounding as the fixed-shape session's are."""
    sources = [tiny_runtime.tokenizer.encode(text) + [tiny_runtime.eos_id] for text in ("abc de", "fg hij", "k")]
    report = static_step.measure(tiny_model_repository, tiny_runtime, sources, 16)
    packed, norms, both = (report[f"static, {name}"] for name in
                           ("packed projections", "fused layer norms", "packed projections, fused layer norms"))
    assert packed["steps"] == norms["steps"] == both["steps"] == report["dynamic"]["steps"]
    assert packed["same_tokens"] == norms["same_tokens"] == both["same_tokens"] == 1.0
    assert packed["max_logit_difference"] < 1e-5 and max(norms["max_logit_difference"], both["max_logit_difference"]) < 1e-4
    counts = report["graph_nodes"]  # each rewrite's graph has fewer nodes than the shipped one
    assert counts["dynamic"] == counts["static"] > counts["static, packed projections"] > counts[
        "static, packed projections, fused layer norms"]
    assert counts["static"] > counts["static, fused layer norms"] > counts["static, packed projections, fused layer norms"]
    with tempfile.TemporaryDirectory() as folder:
        paths = {name: static_step.write_variant(tiny_model_repository, tiny_runtime, rewrite, Path(folder))
                 for name, rewrite in static_step.GRAPH_VARIANTS.items()}
        shipped = load_graph(static_step.step_graph_path(tiny_model_repository, tiny_runtime))
        ops = {name: Counter(n.op_type for n in onnx.load(str(path)).graph.node) for name, path in paths.items()}
    layers = read_manifest(tiny_model_repository).config.n_decoder_layers
    before = Counter(n.op_type for n in shipped.graph.node)
    assert ops["packed projections"]["MatMul"] == before["MatMul"] - 2 * layers
    assert ops["fused layer norms"]["SkipLayerNormalization"] == ops["packed projections, fused layer norms"][
        "SkipLayerNormalization"] == before["LayerNormalization"] >= 2 * layers
    assert ops["fused layer norms"]["LayerNormalization"] == 0 and ops["fused layer norms"]["MatMul"] == before["MatMul"]
