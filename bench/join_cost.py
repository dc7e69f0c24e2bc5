"""What joining costs a running batch: continuous batching in-process, with and without
newcomers taking the slots of rows that left (and what greedy scores cost its steps).

    python -m bench.join_cost --model models/translate-en-it --data-dir data --out bench/results/join_cost_cpu.json

Replays the first `--sentences` test sources through one `RunningBatch` (one intra-op thread, as
each batch worker has): whenever fewer than `--rows` rows are decoding, the next `--group`
sources join, then one decoder step runs. Each mode (newcomers fill dead slots in place, or
every join copies the batch; and the first again with each token's log-probability summed, which
the service skips) runs `--repeats` times in turn; it reports the seconds spent in joins (encoder
calls, copies), in copies alone and in decoder steps, the median run of each.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import machine

# mode -> RunningBatch (trim_slack, scores); the service's batch is the first
MODES = {"dead slots filled in place": (4, False), "every join copies the batch": (-1, False),
         "dead slots filled in place, greedy scores (a log-softmax per step)": (4, True)}


def replay(runtime: Any, sources: list[list[int]], rows: int, group: int, trim_slack: int,
           scores: bool = False) -> dict[str, float]:
    """Seconds in joins, in the batch copies and in steps; the counts of copies and steps."""
    from service.continuous import RunningBatch

    batch: RunningBatch[int] = RunningBatch(runtime, trim_slack=trim_slack, scores=scores)
    copy_s, copies = 0.0, 0
    rebuild = batch._rebuild

    def timed_rebuild(newcomers: list[Any]) -> None:
        nonlocal copy_s, copies
        started = time.perf_counter()
        rebuild(newcomers)
        copy_s += time.perf_counter() - started
        copies += 1

    batch._rebuild = timed_rebuild  # type: ignore[method-assign]
    joins = steps = 0.0
    count = 0
    index = 0
    while index < len(sources) or len(batch):
        if index < len(sources) and len(batch) < rows:
            newcomers = sources[index:index + group]
            started = time.perf_counter()
            batch.add(newcomers, list(range(index, index + len(newcomers))), [runtime.max_target_len] * len(newcomers))
            joins += time.perf_counter() - started
            index += len(newcomers)
        started = time.perf_counter()
        batch.step()
        steps += time.perf_counter() - started
        count += 1
    return {"join_s": joins, "copy_s": copy_s, "copies": copies, "step_s": steps, "steps": count}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/join_cost_cpu.json"))
    parser.add_argument("--sentences", type=int, default=400)
    parser.add_argument("--rows", type=int, default=20, help="newcomers join while fewer rows decode")
    parser.add_argument("--group", type=int, default=3, help="sources per join")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from export.manifest import read_manifest
    from model.tokenizer import Tokenizer
    from service.runtime import ModelRuntime

    manifest = read_manifest(args.model)
    tokenizer = Tokenizer.from_file(args.model / "tokenizer.model")
    runtime = ModelRuntime.load(args.model, providers=["CPUExecutionProvider"], threads=1, spinning=False,
                                memory_arena=False)
    lines = (args.data_dir / manifest.name / "test.src").read_text(encoding="utf-8").splitlines()
    sources = [tokenizer.encode(line)[: runtime.max_source_len - 1] + [runtime.eos_id]
               for line in lines[: args.sentences]]
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode, (trim_slack, scores) in MODES.items():
            runs[mode].append(replay(runtime, sources, args.rows, args.group, trim_slack, scores))
    results = {
        "command": "python -m bench.join_cost " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine.describe(), "model": manifest.name, "sentences": len(sources),
        "rows": args.rows, "group": args.group,
        "modes": {mode: {"median": {key: statistics.median(run[key] for run in mode_runs)
                                    for key in mode_runs[0]}, "runs": mode_runs}
                  for mode, mode_runs in runs.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    for mode, values in results["modes"].items():
        median = values["median"]
        print(f"{mode}: joins {median['join_s']:.3f} s ({median['copies']:.0f} copies, {median['copy_s']:.3f} s), "
              f"steps {median['step_s']:.3f} s over {median['steps']:.0f} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
