"""What beam search adds to a running batch's steps, in-process: the same sources through one
`SlotBatch`, with a share of them beam-searched (`mixed`) or sent as that many greedy rows each
(`as_greedy`: the same rows of work, no beam search), in alternating turns.

The sources join in order while fewer than `--rows` slots decode (a row of beam k holds k
slots), as the service's running batch takes them; one thread, the served variant. The
difference between the two arms is beam search's own work per step (the log-softmax, the top
candidates of each beam row, the copies of the caches of beams that change parents) and its
longer rows (a beam row runs until k hypotheses finish). Results: `<out>/beam_step.json` and
`.md`.

    python -m bench.beam_step --model models/translate-en-it --data-dir data --out bench/results/beam_step
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import machine
from bench.workload import read_lines

ARMS = ("mixed", "as_greedy")


def replay(runtime: Any, sources: list[list[int]], beams: list[int], rows: int) -> tuple[float, int]:
    """Seconds and decoder steps to decode `sources` (source i at beam `beams[i]`) through one
    `SlotBatch` that takes them in order while fewer than `rows` slots decode (a source of more
    beams than `rows` joins an empty batch alone, as the service's join policy lets it)."""
    from service.batching.slot_batch import SlotBatch

    batch: SlotBatch[int] = SlotBatch(runtime, scores=False, rows=rows)
    limit = runtime.max_target_len
    index = steps = 0
    started = time.perf_counter()
    while index < len(sources) or len(batch):
        first = index
        free = rows - len(batch)
        while index < len(sources) and (beams[index] <= free or free == rows):
            free -= beams[index]
            index += 1
        if index > first:
            batch.concatenate(sources[first:index], list(range(first, index)), [limit] * (index - first),
                              beam_sizes=beams[first:index])
        batch.generate_token()
        steps += 1
    return time.perf_counter() - started, steps


def arm_work(sources: list[list[int]], beam: list[bool], beam_size: int, arm: str) -> tuple[list[list[int]], list[int]]:
    """The sources and beam sizes of `arm`: the beam sources at `beam_size` (`mixed`), or each
    repeated `beam_size` times at beam 1 (`as_greedy`)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}")
    out_sources: list[list[int]] = []
    out_beams: list[int] = []
    for source, searched in zip(sources, beam, strict=True):
        if searched and arm == "mixed":
            out_sources.append(source)
            out_beams.append(beam_size)
        else:
            copies = beam_size if searched else 1
            out_sources += [source] * copies
            out_beams += [1] * copies
    return out_sources, out_beams


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Beam search in the running batch, in-process",
        "",
        f"Command: `{result['command']}`",
        "",
        (f"Machine: {result['machine'].get('cpu')}, {result['machine'].get('cpu_count')} cores. "
         f"{result['sentences']} test sources, {result['beam_share']:.0%} of them at beam "
        f"{result['beam_size']} (`as_greedy`: each sent as {result['beam_size']} greedy rows instead); one `SlotBatch` "
        f"of up to {result['rows']} slots, one thread, {result['turns']} turns of each arm in turn."),
        "",
        "| arm | replay s, median (range) | decoder steps | ms per step |",
        "|---|---|---|---|",
    ]
    for arm in ARMS:
        runs = result["arms"][arm]
        seconds = [r["seconds"] for r in runs]
        median = statistics.median(seconds)
        steps = runs[0]["steps"]
        lines.append(f"| {arm} | {median:.3f} ({min(seconds):.3f}-{max(seconds):.3f}) | {steps} | "
                     f"{1000 * median / steps:.3f} |")
    lines += ["", (f"mixed / as_greedy, turn by turn: {', '.join(f'{r:.3f}' for r in result['ratios'])} "
              f"(median **{statistics.median(result['ratios']):.3f}**)."), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.beam_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sentences", type=int, default=600)
    parser.add_argument("--beam-share", type=float, default=0.1)
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--rows", type=int, default=48, help="slots the batch fills up to")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from bench.in_process import load_runtime
    from model.tokenizer import Tokenizer

    runtime = load_runtime(args.model, threads=1)
    tokenizer = Tokenizer.from_file(args.model / "tokenizer.model")
    limit = runtime.max_source_len - 1
    sources = [tokenizer.encode(line)[:limit] + [runtime.eos_id]
               for line in read_lines(args.data_dir / args.model.name / "test.src", args.sentences)]
    rng = random.Random(args.seed)
    beam = [rng.random() < args.beam_share for _ in sources]
    work = {arm: arm_work(sources, beam, args.beam_size, arm) for arm in ARMS}
    for arm in ARMS:  # warm-up: sessions, allocator
        replay(runtime, *work[arm], args.rows)
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for turn in range(args.turns):
        for arm in (ARMS if turn % 2 == 0 else ARMS[::-1]):
            seconds, steps = replay(runtime, *work[arm], args.rows)
            runs[arm].append({"seconds": round(seconds, 4), "steps": steps})
            print(f"{arm}: {seconds:.3f} s, {steps} steps", file=sys.stderr)
    result = {
        "command": "python -m bench.beam_step " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine.describe(), "model": args.model.name, "sentences": len(sources),
        "beam_share": args.beam_share, "beam_size": args.beam_size, "rows": args.rows, "turns": args.turns,
        "arms": runs,
        "ratios": [m["seconds"] / g["seconds"] for m, g in zip(runs["mixed"], runs["as_greedy"], strict=True)],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "beam_step.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "beam_step.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
