"""What joining costs a running batch: continuous batching in-process, on the step graph (each
row in its own slot) and on the merged decoder, with and without newcomers taking the slots of
rows that left (and what greedy scores cost its steps).

    python -m bench.join_cost --model models/translate-en-it --data-dir data --out bench/results/join_cost_cpu.json

Replays the first `--sentences` test sources through one `RunningBatch` (one intra-op thread, as
each batch worker has): whenever fewer than `--rows` rows are decoding, the next `--group`
sources join (fewer when only fewer fit: the batch never holds more than `--rows`, as the
service's admission keeps it), then one decoder step runs. Each mode (`SlotBatch` on the step graph; on the merged
decoder, newcomers fill dead slots in place, or every join copies the batch, and the first again
with each token's log-probability summed, which the service skips) runs `--repeats` times in turn; it reports the seconds spent in joins (encoder
calls, copies), in copies alone and in decoder steps, the median run of each (`--modes` picks
some). Within the steps, the step graph's departures (the last rows moving into the slots of
rows that finished) are timed apart. `--provider CUDAExecutionProvider` runs it on the GPU (its
slots on the device); `--device-slots` keeps the slots on the runtime's device with IO binding on
the CPU too, where joins, departures and resizes run the same slot graphs as on CUDA, and
`--variant` picks the repository's variant (device slots hold a float cache: fp32).

With `--profile`, one more replay of the step graph on sessions with onnxruntime's profiler (on
the same providers) gives the step graph's and the encoder's time per operator type, and the
kernels per step on each provider with the host <-> device copies among them (`profile` in the
output).

With `--ctranslate2`, CTranslate2 int8 greedy `translate_batch` on the same weights and sources,
one replica on one thread in batches of `--rows`, runs in the same turns: the two engines at
the same threads and batch size, without a server around either.

With `--against DIR`, the step graph of another repository of the same model (an earlier export,
e.g. from a worktree of an earlier commit) replays the same sources in the same turns: two
exports of one model compared on the same machine state.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import machine
from bench.stats import timed_calls


def _merged(trim_slack: int, scores: bool) -> Callable[[Any], Any]:
    def make(runtime: Any) -> Any:
        from service.batching.running_batch import RunningBatch

        return RunningBatch(runtime, trim_slack=trim_slack, scores=scores)
    return make


def _slots(runtime: Any) -> Any:
    from service.batching.slot_batch import SlotBatch

    return SlotBatch(runtime, scores=False)


def _device_slots(runtime: Any) -> Any:
    from service.batching.slot_batch import SlotBatch

    return SlotBatch(runtime, scores=False, on_device=True)


# mode -> a running batch over the runtime; the service's batch is the step graph's when the
# model has one (`service.core.registry.onnx_running_batch`), else the second
STEP_MODE = "step graph, each row in its own slot"
MODES: dict[str, Callable[[Any], Any]] = {
    STEP_MODE: _slots,
    "merged decoder, dead slots filled in place": _merged(4, False),
    "merged decoder, every join copies the batch": _merged(-1, False),
    "merged decoder, dead slots filled in place, greedy scores (a log-softmax per step)": _merged(4, True),
}


def replay(runtime: Any, sources: list[list[int]], rows: int, group: int,
           make_batch: Callable[[Any], Any]) -> dict[str, float]:
    """Seconds in joins and, within them, in the runtime's encoder calls (`encode_s`) and the
    batch copies (RunningBatch's rebuilds, SlotBatch's resizes), in steps and, within them, in
    SlotBatch's departures (the last rows moved into the finished rows' slots) and in
    onnxruntime's step graph calls (`step_runtime_s`: the rest of a step is the Python between
    two calls); the counts of joins, encoder calls, copies, departures and steps."""
    batch = make_batch(runtime)
    step_session = getattr(runtime, "step", None)
    copy_method = "_rebuild" if hasattr(batch, "_rebuild") else "_resize"
    joins = steps = 0.0
    count = groups = 0
    index = 0
    begun = time.perf_counter()
    with (timed_calls([runtime], "encode") as encodes,
          timed_calls([batch], copy_method) as copies,
          timed_calls([batch] if hasattr(batch, "_remove") else [], "_remove") as leaves,
          timed_calls([step_session] if step_session is not None else [], "run_with_iobinding") as in_runtime):
        while index < len(sources) or len(batch):
            if index < len(sources) and len(batch) < rows:  # at most `group`, never past `rows` (as admission)
                newcomers = sources[index:index + min(group, rows - len(batch))]
                started = time.perf_counter()
                batch.concatenate(newcomers, list(range(index, index + len(newcomers))),
                                  [runtime.max_target_len] * len(newcomers))
                joins += time.perf_counter() - started
                groups += 1
                index += len(newcomers)
            started = time.perf_counter()
            batch.generate_token()
            steps += time.perf_counter() - started
            count += 1
        total = time.perf_counter() - begun
    return {"join_s": joins, "joins": groups, "encode_s": encodes[0], "encodes": int(encodes[1]),
            "copy_s": copies[0], "copies": int(copies[1]), "step_s": steps,
            "step_runtime_s": in_runtime[0], "leave_s": leaves[0], "leaves": int(leaves[1]), "steps": count,
            "total_s": total}


def profile(model_dir: Path, sources: list[list[int]], rows: int, group: int,
            providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> dict[str, Any]:
    """One replay of the step graph on profiled sessions of `providers`: per operator type of
    the step graph (per step) and of the encoder (per join), with the kernels per step on each
    provider and the host <-> device copies among them (`op_times`). The lone slot is off (its
    own session is not the one profiled): a lone row steps on the batch's step graph."""
    from bench.decoder_profile import op_times
    from service.runtime import ModelRuntime

    with tempfile.TemporaryDirectory(prefix="join-cost-profile-") as scratch:
        runtime = ModelRuntime.load(model_dir, providers=list(providers), threads=1, spinning=False,
                                    memory_arena=False, profile_prefix=str(Path(scratch) / "onnxruntime"),
                                    lone_step=False)
        counted = replay(runtime, sources, rows, group, _slots)
        assert runtime.step is not None
        return {
            "step_graph": op_times(json.loads(Path(runtime.step.end_profiling()).read_text(encoding="utf-8")),
                                   int(counted["steps"])),
            "encoder": op_times(json.loads(Path(runtime.encoder.end_profiling()).read_text(encoding="utf-8")),
                                int(counted["joins"])),
        }


CTRANSLATE2 = "CTranslate2 int8 translate_batch, one replica on one thread"


def _ctranslate2(model_dir: Path, tokenizer: Any, sources: list[list[int]], rows: int,
                 max_target_len: int, scratch: Path) -> Callable[[], dict[str, float]]:
    """A function that times CTranslate2 int8 greedy over `sources` in batches of `rows` (one
    replica, one thread)."""
    from bench import ctranslate2_runs

    pieces = [tokenizer.pieces(ids) for ids in sources]
    run = ctranslate2_runs.int8_greedy(model_dir, scratch, pieces, max_target_len,
                                       ctranslate2_runs.Ct2Settings(1, 1, rows, "examples"))
    return lambda: {"total_s": run().elapsed_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/join_cost_cpu.json"))
    parser.add_argument("--provider", default="CPUExecutionProvider", choices=["CPUExecutionProvider", "CUDAExecutionProvider"],
                        help="the runtime's execution provider (CUDA: the CPU for the nodes it has no kernel for)")
    parser.add_argument("--sentences", type=int, default=400)
    parser.add_argument("--rows", type=int, default=20, help="newcomers join while fewer rows decode")
    parser.add_argument("--group", type=int, default=3, help="sources per join")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--profile", action="store_true",
                        help="also profile one replay of the step graph per operator type")
    parser.add_argument("--ctranslate2", action="store_true",
                        help="also time CTranslate2 int8 on one thread in batches of --rows (needs ctranslate2)")
    parser.add_argument("--against", type=Path, default=None,
                        help="another repository of the model whose step graph replays in the same turns")
    parser.add_argument("--variant", default=None, help="the repository's variant (default: the provider's)")
    parser.add_argument("--device-slots", action="store_true",
                        help="the step graph's slots on the runtime's device with IO binding, also on the CPU "
                        "(as CUDA batches: departures and joins run the slot graphs)")
    args = parser.parse_args(argv)
    from model.tokenizer import Tokenizer
    from service.repository.manifest import ManifestError, read_manifest
    from service.runtime import ModelLoadError, ModelRuntime

    manifest = read_manifest(args.model)
    tokenizer = Tokenizer.from_file(args.model / "tokenizer.model")
    providers = [args.provider, "CPUExecutionProvider"] if args.provider != "CPUExecutionProvider" else [args.provider]
    runtime = ModelRuntime.load(args.model, providers=providers, threads=1, spinning=False, memory_arena=False,
                                variant=args.variant, io_binding=True if args.device_slots else None)
    slots = _device_slots if args.device_slots else _slots
    lines = (args.data_dir / manifest.name / "test.src").read_text(encoding="utf-8").splitlines()
    sources = [tokenizer.encode(line)[: runtime.max_source_len - 1] + [runtime.eos_id]
               for line in lines[: args.sentences]]
    against = None
    if args.against is not None:
        try:
            against = (ModelRuntime.load(args.against, providers=["CPUExecutionProvider"], threads=1,
                                         spinning=False, memory_arena=False)
                       if read_manifest(args.against).name == manifest.name else None)
        except (ManifestError, ModelLoadError):
            pass
        if against is None or against.step is None:
            parser.error(f"--against {args.against}: not a repository of {manifest.name} with a step graph")
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    with tempfile.TemporaryDirectory(prefix="join-cost-") as scratch:
        reference = (_ctranslate2(args.model, tokenizer, sources, args.rows, manifest.max_target_len,
                                  Path(scratch)) if args.ctranslate2 else None)
        for _ in range(args.repeats):
            if reference is not None:
                runs.setdefault(CTRANSLATE2, []).append(reference())
            for mode in args.modes:
                make_batch = MODES[mode]
                if make_batch is _slots and runtime.step is None:
                    continue
                make_batch = slots if make_batch is _slots else make_batch
                runs[mode].append(replay(runtime, sources, args.rows, args.group, make_batch))
            if against is not None:
                runs.setdefault(f"{STEP_MODE} ({args.against})", []).append(
                    replay(against, sources, args.rows, args.group, _slots))
    runs = {mode: mode_runs for mode, mode_runs in runs.items() if mode_runs}
    results = {
        "command": "python -m bench.join_cost " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine.describe(), "model": manifest.name, "sentences": len(sources),
        "provider": runtime.provider, "variant": runtime.variant, "rows": args.rows, "group": args.group,
        "device_slots": args.device_slots,
        "modes": {mode: {"median": {key: statistics.median(run[key] for run in mode_runs)
                                    for key in mode_runs[0]}, "runs": mode_runs}
                  for mode, mode_runs in runs.items()},
    }
    if args.profile and runtime.step is not None:
        results["profile"] = profile(args.model, sources, args.rows, args.group, tuple(providers))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    for mode, values in results["modes"].items():
        median = values["median"]
        if mode == CTRANSLATE2:
            print(f"{mode}: {median['total_s']:.3f} s")
            continue
        print(f"{mode}: joins {median['join_s']:.3f} s (the encoder {median['encode_s']:.3f} s, "
              f"{median['copies']:.0f} copies, {median['copy_s']:.3f} s), "
              f"steps {median['step_s']:.3f} s over {median['steps']:.0f} steps "
              f"({median['leaves']:.0f} departures, {median['leave_s']:.3f} s; "
              f"{median.get('step_runtime_s', 0.0):.3f} s in onnxruntime)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
