"""A lone row's decoder steps on a step graph of fixed shapes, and replayed as a CUDA graph.

The service decodes a request that is alone in its running batch in the runtime's lone slot
(`service.runtime.lone_slots`: one row, `max_target_len` cache columns, `max_source_len` source
width, the step graph's dimensions fixed, on CUDA replayed as a CUDA graph). This measures what
that buys, on the same lone slot.

`measure` decodes the same sources greedily, each on its own, three ways, each step's next token
written in place into the bound inputs and the logits read back (each sentence through every way
in turn, the first way rotating from one sentence to the next, decoded twice and the second
timed: a drift of the GPU's clocks over the run falls on every way alike):
- `dynamic`: the runtime's own step-graph session, at the same fixed shapes;
- `static`: a session of the same graph with the dimensions fixed;
- `cuda_graph`: that session replaying a CUDA graph (CUDA only; otherwise, or when onnxruntime
  refuses, the reason);
and the same fixed-shape way (on CUDA the CUDA graph, else `static`) on rewritten copies of the
step graph (`GRAPH_VARIANTS`: each self-attention's query, key and value as one packed product,
`export.fused_projections.fuse_float_projections`; each residual Add and the LayerNormalization
after it as one `SkipLayerNormalization`, `bench.step_variants.fuse_skip_layer_norms`; both), whose
kernels a lone row's step on a GPU waits on one after the other. It reports each one's
milliseconds per step, whether its tokens are the dynamic session's, and its largest logit
difference from it while they agree, and each way's graph's node count (`graph_nodes`: the
graph as `export.storage.load_graph` reads it, its weights' casts folded, before onnxruntime's
own optimizations). `make gpu-check` runs it beside
`step_graph_alone` (the service's own path at concurrency 1, the lone slot on CUDA).

    python -m bench.static_step --model models/translate-en-it --data-dir data --sentences 16
    python -m bench.static_step --model models/translate-en-it --data-dir data --variant fp32   # a float graph on the CPU
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from bench.report import emit_json
from bench.step_variants import fuse_skip_layer_norms
from export.fused_projections import fuse_float_projections
from export.storage import load_graph
from service.runtime import CPU, CUDA, ModelRuntime
from service.runtime.lone_slots import LoneSlots, fixed_dimensions, lone_session
from service.runtime.tensors import to_numpy

_FLOAT_CACHES = ("tensor(float)", "tensor(float16)")


def packed_projections(graph: onnx.ModelProto) -> onnx.ModelProto:
    """`graph` with each self-attention's query, key and value as one packed product."""
    fuse_float_projections(graph)
    return graph


def packed_projections_and_norms(graph: onnx.ModelProto) -> onnx.ModelProto:
    """`packed_projections`, and each residual Add with its LayerNormalization as one node."""
    return fuse_skip_layer_norms(packed_projections(graph))


GRAPH_VARIANTS: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]] = {
    "packed projections": packed_projections,
    "fused layer norms": fuse_skip_layer_norms,
    "packed projections, fused layer norms": packed_projections_and_norms,
}


def step_graph_path(model_dir: Path, runtime: ModelRuntime) -> Path:
    """The runtime's variant's step graph in the repository `model_dir`."""
    return model_dir / runtime.manifest.variants[runtime.variant].step_decoder


def write_variant(model_dir: Path, runtime: ModelRuntime, rewrite: Callable[[onnx.ModelProto], onnx.ModelProto],
                  folder: Path) -> Path:
    """The runtime's step graph, its weights read in, rewritten by `rewrite` and saved whole
    (weights inside) in `folder`: its path."""
    path = folder / f"{len(list(folder.iterdir()))}.onnx"
    onnx.save(rewrite(load_graph(step_graph_path(model_dir, runtime))), str(path))
    return path


def static_session(model_dir: Path, runtime: ModelRuntime, cuda_graph: bool = False,
                   path: Path | None = None) -> ort.InferenceSession:
    """The runtime's step graph (or the graph at `path`) in a session with the lone slot's fixed
    dimensions (`service.runtime.lone_slots.lone_session`), on the runtime's provider (with
    `cuda_graph`, CUDA's graph capture on)."""
    return lone_session(path or step_graph_path(model_dir, runtime), runtime.provider, _dimensions(runtime), cuda_graph,
                        threads=1 if runtime.provider == CPU else 0, device_id=runtime.device_id,
                        fold_dequantize=runtime.variant == "int8")


def _dimensions(runtime: ModelRuntime) -> dict[str, int]:
    return fixed_dimensions(runtime.max_target_len, runtime.max_source_len)


def decode(row: LoneSlots, runtime: ModelRuntime, source: list[int],
           max_new_tokens: int) -> tuple[list[int], list[np.ndarray], float]:
    """Greedy decoding of one source on `row`: its tokens (EOS left out), each step's logits and
    the seconds its steps took."""
    state = runtime.encode(runtime.pad([source]))
    row.write(0, [to_numpy(t) for pair in zip(state.cross_keys, state.cross_values, strict=True) for t in pair])
    mask = np.zeros((1, row.width), dtype=bool)
    mask[0, :len(source)] = True
    tokens: list[int] = []
    steps: list[np.ndarray] = []
    token = runtime.decoder_start_id
    started = time.perf_counter()
    for position in range(min(max_new_tokens, runtime.max_target_len)):
        logits = row.step(row.session, np.array([[token]]), np.array([[position]]), mask)[0]
        steps.append(logits)
        token = int(logits.argmax())
        if token == runtime.eos_id:
            break
        tokens.append(token)
    return tokens, steps, time.perf_counter() - started


def measure(model_dir: Path, runtime: ModelRuntime, sources: Sequence[list[int]],
            max_new_tokens: int | None = None,
            graph_variants: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]] | None = None) -> dict[str, Any]:
    """The module docstring's ways over `sources` (interleaved, each decoded twice, the second timed), the
    step graph's rewrites `graph_variants` (default `GRAPH_VARIANTS`) included: ms per step,
    tokens the same as `dynamic`'s, largest logit difference while they agree."""
    if runtime.step is None:
        return {"error": "the variant has no step graph"}
    cache_type = {i.name: i.type for i in runtime.step.get_inputs()}["past_key.0"]
    if cache_type not in _FLOAT_CACHES:
        return {"error": f"the step graph's cache is {cache_type} (export.kv_cache): a float graph only"}
    with tempfile.TemporaryDirectory(prefix="static-step-") as folder:
        return _measure(model_dir, runtime, sources, max_new_tokens or runtime.max_target_len,
                        GRAPH_VARIANTS if graph_variants is None else graph_variants, Path(folder))


def _session_or_reason(make: Callable[[], ort.InferenceSession]) -> ort.InferenceSession | str:
    try:
        return make()
    except Exception as error:  # noqa: BLE001 - onnxruntime's refusal is the finding
        return f"{type(error).__name__}: {error}"


def _measure(model_dir: Path, runtime: ModelRuntime, sources: Sequence[list[int]], limit: int,
             graph_variants: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]], folder: Path) -> dict[str, Any]:
    sessions: dict[str, ort.InferenceSession | str] = {"dynamic": runtime.step, "static": static_session(model_dir, runtime)}
    cuda = runtime.provider == CUDA
    if not cuda:
        sessions["cuda_graph"] = f"CUDA graphs need the CUDA provider (this runtime is on {runtime.provider})"
    else:
        sessions["cuda_graph"] = _session_or_reason(lambda: static_session(model_dir, runtime, cuda_graph=True))
    shipped = len(load_graph(step_graph_path(model_dir, runtime)).graph.node)  # as the rewrites read it
    nodes = dict.fromkeys(sessions, shipped)
    for name, rewrite in graph_variants.items():
        way = f"{'cuda_graph' if cuda else 'static'}, {name}"

        def make(rewrite: Callable[[onnx.ModelProto], onnx.ModelProto] = rewrite, way: str = way) -> ort.InferenceSession:
            path = write_variant(model_dir, runtime, rewrite, folder)
            nodes[way] = len(onnx.load(str(path), load_external_data=False).graph.node)
            return static_session(model_dir, runtime, cuda_graph=cuda, path=path)

        sessions[way] = _session_or_reason(make)
    report: dict[str, Any] = {"sentences": len(sources), "fixed_dimensions": _dimensions(runtime),
                              "order": "interleaved: each sentence through every way in turn, the first way rotating",
                              "graph_nodes": nodes}
    rows: dict[str, LoneSlots] = {}
    for name, session in sessions.items():
        if isinstance(session, str):
            report[name] = {"error": session}
            continue
        try:  # the first decode: warm-up, on CUDA the graph's capture
            rows[name] = LoneSlots.of(runtime, session)
            decode(rows[name], runtime, sources[0], limit)
        except Exception as error:  # noqa: BLE001 - a graph onnxruntime cannot capture is the finding
            report[name] = {"error": f"{type(error).__name__}: {error}"}
            rows.pop(name, None)
    if "dynamic" not in rows:
        return report
    decoded: dict[str, list[tuple[list[int], list[np.ndarray], float]]] = {name: [] for name in rows}
    ways = list(rows)
    for i, source in enumerate(sources):
        for name in ways[i % len(ways):] + ways[:i % len(ways)]:
            if name not in rows:
                continue
            try:
                decode(rows[name], runtime, source, limit)  # each sentence twice, the second timed
                decoded[name].append(decode(rows[name], runtime, source, limit))
            except Exception as error:  # noqa: BLE001 - a failure midway is the finding too
                report[name] = {"error": f"{type(error).__name__}: {error}"}
                del rows[name]
    reference = decoded["dynamic"]
    for name in rows:
        seconds = sum(took for _, _, took in decoded[name])
        steps = sum(len(logits) for _, logits, _ in decoded[name])
        report[name] = {"ms_per_step": 1000 * seconds / max(steps, 1), "steps": steps}
        if name == "dynamic":
            continue
        same, difference = 0, 0.0
        for (tokens, logits, _), (expected, expected_logits, _) in zip(decoded[name], reference, strict=True):
            same += tokens == expected
            for ours, theirs in zip(logits, expected_logits, strict=False):
                difference = max(difference, float(np.abs(ours - theirs).max()))
                if int(ours.argmax()) != int(theirs.argmax()):
                    break
        report[name].update(same_tokens=same / max(len(sources), 1), max_logit_difference=difference)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.static_step", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--provider", default=CPU, choices=[CPU, CUDA])
    parser.add_argument("--variant", default=None, help="the repository's variant (default: the provider's)")
    parser.add_argument("--sentences", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="also write the report here (JSON)")
    args = parser.parse_args(argv)
    from bench.in_process import load_runtime
    from bench.workload import load as load_workload
    from service.repository.manifest import read_manifest

    manifest = read_manifest(args.model)
    providers = [args.provider] if args.provider == CPU else [args.provider, CPU]
    runtime = load_runtime(args.model, 1 if args.provider == CPU else 0, variant=args.variant, providers=providers)
    work = load_workload(args.data_dir, args.model.name, manifest.task, runtime.tokenizer, manifest.max_source_len,
                         args.sentences)
    report = {"command": "python -m bench.static_step " + shlex.join(sys.argv[1:] if argv is None else argv),
              "model": manifest.name, "provider": runtime.provider, "variant": runtime.variant,
              **measure(args.model, runtime, work.source_ids)}
    emit_json(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
