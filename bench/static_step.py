"""A lone row's decoder steps on a step graph of fixed shapes, and replayed as a CUDA graph.

At concurrency 1 the service decodes through a one-row running batch on the step graph, whose
cache columns and source width change as it goes; on a GPU each such step launches its kernels
one by one and syncs where onnxruntime placed shape arithmetic on the CPU, which is what a single
request's latency is made of there. With every dimension fixed (free dimension overrides: one
row, `max_target_len` cache columns, `max_source_len` source width) onnxruntime folds that
arithmetic into constants at load, and on CUDA a session whose nodes all run there, with every
input and output bound at one device address, can capture its first steps as a CUDA graph and
replay it (`enable_cuda_graph`). The graph reads each row's own cache and source lengths, so the
fixed spare columns and width cost no attention.

`measure` decodes the same sources greedily, each on its own, three ways, each step's next token
written in place into the bound inputs and the logits read back:
- `dynamic`: the runtime's own step-graph session, at the same fixed shapes;
- `static`: a session of the same graph with the dimensions fixed;
- `cuda_graph`: that session replaying a CUDA graph (CUDA only; otherwise, or when onnxruntime
  refuses, the reason);
and reports each one's milliseconds per step, whether its tokens are the dynamic session's, and
its largest logit difference from it while they agree. `make gpu-check` runs it beside
`step_graph_alone` (the service's own path at concurrency 1).

    python -m bench.static_step --model models/translate-en-it --data-dir data --sentences 16
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from service.repository import graph_io
from service.runtime import CPU, CUDA, ModelRuntime
from service.runtime.providers import execution_providers, session_options
from service.runtime.tensors import to_numpy

_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def fixed_dimensions(runtime: ModelRuntime) -> dict[str, int]:
    """The step graph's free dimensions, fixed for a lone row at the model's limits."""
    return {"batch": 1, "capacity": runtime.max_target_len, "source_len": runtime.max_source_len}


def static_session(model_dir: Path, runtime: ModelRuntime, cuda_graph: bool = False) -> ort.InferenceSession:
    """The runtime's step graph in a session with `fixed_dimensions`, on the runtime's provider
    (with `cuda_graph`, CUDA's graph capture on)."""
    variant = runtime.manifest.variants[runtime.variant]
    options = session_options(1 if runtime.provider == CPU else 0, spinning=False,
                              fold_dequantize=runtime.variant == "int8")
    for name, value in fixed_dimensions(runtime).items():
        options.add_free_dimension_override_by_name(name, value)
    providers: list[Any] = execution_providers(runtime.provider)
    if cuda_graph:
        providers = [(CUDA, {"enable_cuda_graph": "1"}), CPU]
    return ort.InferenceSession(str(model_dir / variant.step_decoder), options, providers=providers)


class LoneRow:
    """One row's step-graph inputs and outputs as OrtValues allocated once at fixed addresses on
    the runtime's device and bound once to `session` (a CUDA graph replays those addresses):
    `start` writes a source's cross keys/values and mask in place, `step` the token and position."""

    def __init__(self, session: ort.InferenceSession, runtime: ModelRuntime) -> None:
        self.session = session
        device, device_id = ("cuda", runtime.device_id) if runtime.provider == CUDA else ("cpu", 0)
        types = {i.name: i.type for i in session.get_inputs()}
        dims = fixed_dimensions(runtime)
        layers, heads, head_dim = runtime.n_decoder_layers, runtime.n_heads, runtime.head_dim
        outputs = {o.name for o in session.get_outputs()}

        def value(array: np.ndarray) -> ort.OrtValue:
            return ort.OrtValue.ortvalue_from_numpy(array, device, device_id)

        self.token, self.position = value(np.zeros((1, 1), np.int64)), value(np.zeros((1, 1), np.int64))
        self.mask = value(np.zeros((1, dims["source_len"]), dtype=bool))
        self.binding = session.io_binding()
        for name, bound in (("input_ids", self.token), ("positions", self.position), ("source_mask", self.mask)):
            self.binding.bind_ortvalue_input(name, bound)
        self.cross: list[ort.OrtValue] = []
        for name in graph_io.cross_names(layers):
            self.cross.append(value(np.zeros((1, heads, dims["source_len"], head_dim), dtype=_DTYPES[types[name]])))
            self.binding.bind_ortvalue_input(name, self.cross[-1])
            if f"present_{name}" in outputs:
                self.binding.bind_ortvalue_output(f"present_{name}", self.cross[-1])
        self.cache: list[ort.OrtValue] = []  # a row reads its own columns only: never cleared
        for past, present in zip(graph_io.past_names(layers), graph_io.present_names(layers), strict=True):
            self.cache.append(value(np.zeros((1, heads, dims["capacity"], head_dim), dtype=_DTYPES[types[past]])))
            self.binding.bind_ortvalue_input(past, self.cache[-1])
            self.binding.bind_ortvalue_output(present, self.cache[-1])
        vocab = session.get_outputs()[0].shape[-1]
        self.logits = value(np.zeros((1, vocab), dtype=np.float32))
        self.binding.bind_ortvalue_output("logits", self.logits)

    def start(self, cross: Sequence[np.ndarray], source_length: int) -> None:
        """A new source: its (1, h, w, d) cross keys/values (cross_key.0, cross_value.0, ...)
        and its mask, written over the last one's."""
        mask = np.zeros(self.mask.shape(), dtype=bool)
        mask[0, :source_length] = True
        self.mask.update_inplace(mask)
        for target, array in zip(self.cross, cross, strict=True):
            padded = np.zeros(target.shape(), dtype=_DTYPES[target.data_type()])
            padded[:, :, :array.shape[2]] = array
            target.update_inplace(padded)

    def step(self, token: int, position: int) -> np.ndarray:
        """One step: the (vocab,) logits of the row after `token` at `position`."""
        self.token.update_inplace(np.array([[token]], dtype=np.int64))
        self.position.update_inplace(np.array([[position]], dtype=np.int64))
        self.session.run_with_iobinding(self.binding)
        return np.asarray(self.logits.numpy()[0])


def decode(row: LoneRow, runtime: ModelRuntime, source: list[int],
           max_new_tokens: int) -> tuple[list[int], list[np.ndarray], float]:
    """Greedy decoding of one source on `row`: its tokens (EOS left out), each step's logits and
    the seconds its steps took."""
    state = runtime.encode(runtime.pad([source]))
    row.start([to_numpy(t) for pair in zip(state.cross_keys, state.cross_values, strict=True) for t in pair],
              len(source))
    tokens: list[int] = []
    steps: list[np.ndarray] = []
    token = runtime.decoder_start_id
    started = time.perf_counter()
    for position in range(min(max_new_tokens, runtime.max_target_len)):
        logits = row.step(token, position)
        steps.append(logits.copy())
        token = int(logits.argmax())
        if token == runtime.eos_id:
            break
        tokens.append(token)
    return tokens, steps, time.perf_counter() - started


def measure(model_dir: Path, runtime: ModelRuntime, sources: Sequence[list[int]],
            max_new_tokens: int | None = None) -> dict[str, Any]:
    """The module docstring's three ways over `sources` (each decoded twice, the second timed):
    ms per step, tokens the same as `dynamic`'s, largest logit difference while they agree."""
    if runtime.step is None:
        return {"error": "the variant has no step graph"}
    cache_type = {i.name: i.type for i in runtime.step.get_inputs()}["past_key.0"]
    if cache_type not in _DTYPES:
        return {"error": f"the step graph's cache is {cache_type} (export.kv_cache): a float graph only"}
    limit = max_new_tokens or runtime.max_target_len
    sessions: dict[str, ort.InferenceSession | str] = {"dynamic": runtime.step, "static": static_session(model_dir, runtime)}
    if runtime.provider != CUDA:
        sessions["cuda_graph"] = f"CUDA graphs need the CUDA provider (this runtime is on {runtime.provider})"
    else:
        try:
            sessions["cuda_graph"] = static_session(model_dir, runtime, cuda_graph=True)
        except Exception as error:  # noqa: BLE001 - onnxruntime's refusal is the finding
            sessions["cuda_graph"] = f"{type(error).__name__}: {error}"
    reference: list[tuple[list[int], list[np.ndarray]]] = []
    report: dict[str, Any] = {"sentences": len(sources), "fixed_dimensions": fixed_dimensions(runtime)}
    for name, session in sessions.items():
        if isinstance(session, str):
            report[name] = {"error": session}
            continue
        seconds, steps, same, difference = 0.0, 0, 0, 0.0
        try:
            row = LoneRow(session, runtime)
            for i, source in enumerate(sources):
                decode(row, runtime, source, limit)  # the first steps: warm-up, on CUDA the graph's capture
                tokens, logits, took = decode(row, runtime, source, limit)
                seconds, steps = seconds + took, steps + len(logits)
                if name == "dynamic":
                    reference.append((tokens, logits))
                    continue
                same += tokens == reference[i][0]
                for ours, theirs in zip(logits, reference[i][1], strict=False):
                    difference = max(difference, float(np.abs(ours - theirs).max()))
                    if int(ours.argmax()) != int(theirs.argmax()):
                        break
        except Exception as error:  # noqa: BLE001 - a graph onnxruntime cannot capture is the finding
            report[name] = {"error": f"{type(error).__name__}: {error}"}
            continue
        report[name] = {"ms_per_step": 1000 * seconds / max(steps, 1), "steps": steps}
        if name != "dynamic":
            report[name].update(same_tokens=same / max(len(sources), 1), max_logit_difference=difference)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.static_step", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--provider", default=CPU, choices=[CPU, CUDA])
    parser.add_argument("--sentences", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="also write the report here (JSON)")
    args = parser.parse_args(argv)
    from bench.in_process import load_runtime
    from bench.workload import load as load_workload
    from service.repository.manifest import read_manifest

    manifest = read_manifest(args.model)
    providers = [args.provider] if args.provider == CPU else [args.provider, CPU]
    runtime = load_runtime(args.model, 1 if args.provider == CPU else 0, providers=providers)
    work = load_workload(args.data_dir, args.model.name, manifest.task, runtime.tokenizer, manifest.max_source_len,
                         args.sentences)
    report = {"command": "python -m bench.static_step " + shlex.join(sys.argv[1:] if argv is None else argv),
              "model": manifest.name, "provider": runtime.provider, "variant": runtime.variant,
              **measure(args.model, runtime, work.source_ids)}
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
