"""Inclusive shares of named functions in a sampling profile of the server (py-spy's raw
format: one `frame;frame;... count` line per distinct stack, `py-spy record -f raw`).

    py-spy record --native -r 50 -d 40 -p <server pid> -f raw -o profile.raw   # while loaded
    python -m bench.profile_summary profile.raw --out bench/results/profile/c64.json

A function's share is the fraction of samples (over all the server's threads) whose stack
contains it, counted once per sample however deep it recurs. A profile recorded with py-spy's
`--threads` (each stack's first frame names its thread) also gives each thread's share, and
`--thread NAME` summarises that thread's samples alone: the event loop's (`MainThread`) with
`--functions event-loop`, and the functions its samples end in most (`self_share`: where the
time is spent, not under which call).

    python -m bench.profile_summary profile.raw --thread MainThread --functions event-loop
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from bench.report import emit_json

# what the report lists: the batch workers' stepping, the model calls, the slot bookkeeping,
# and the event loop's request handling
FUNCTIONS = (
    "Stepper._step_until_interrupted", "SlotBatch.generate_token", "SlotBatch.concatenate",
    "HostSlots.step", "run_step", "Session.run_with_iobinding", "ModelRuntime.encode",
    "SlotBatch._remove", "SlotBatch._shrink", "SlotBatch._resize", "HostSlots.move_rows", "StepBinding.__init__",
    "choose", "advance",
    "Runner.run", "RequestResponseCycle.run_asgi", "_generate", "prepare", "outputs",
)


# the event loop's request handling: uvicorn's cycle, the routes, the pipeline's parts, the batcher's
# side of a request, pydantic's validation and JSON encoding
EVENT_LOOP_FUNCTIONS = (
    "RequestResponseCycle.run_asgi", "HttpToolsProtocol.data_received", "FastAPI.__call__",
    "solve_dependencies", "run_endpoint_function", "_generate", "prepare", "split", "Tokenizer.encode_batch",
    "outputs", "Tokenizer.decode", "TypeAdapter.validate_python", "TypeAdapter.dump_json", "BatcherPool.submit",
    "Batcher._finish", "RequestMetricsMiddleware.__call__", "ShedMiddleware.__call__",
)
FUNCTION_SETS = {"batch-workers": FUNCTIONS, "event-loop": EVENT_LOOP_FUNCTIONS}


def _samples(lines: list[str], thread: str | None) -> list[tuple[list[str], int]]:
    """Each distinct stack's frames and sample count; with `thread`, that thread's only (its
    first frame, which names it, dropped)."""
    found = []
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        if thread is not None:
            if not frames[0].startswith("thread (") or frames[0].split(": ", 1)[-1] != thread:
                continue
            frames = frames[1:]
        found.append((frames, int(count)))
    return found


def shares(lines: list[str], functions: tuple[str, ...] = FUNCTIONS,
           thread: str | None = None) -> tuple[int, dict[str, float]]:
    """Total samples (of `thread`, when given) and each function's inclusive share of them."""
    total = 0
    counts: Counter[str] = Counter()
    for frames, n in _samples(lines, thread):
        total += n
        for name in {frame.split(" (")[0] for frame in frames}:
            counts[name] += n
    return total, {name: round(counts[name] / max(total, 1), 4) for name in functions}


def self_shares(lines: list[str], thread: str | None = None, top: int = 15) -> dict[str, float]:
    """The `top` functions the samples (of `thread`, when given) end in, each with its share."""
    counts: Counter[str] = Counter()
    for frames, n in _samples(lines, thread):
        counts[frames[-1].split(" (")[0]] += n
    total = sum(counts.values())
    return {name: round(n / total, 4) for name, n in counts.most_common(top)}


def thread_shares(lines: list[str]) -> dict[str, float]:
    """Each thread's share of the samples, by its name (`--threads` profiles; empty otherwise)."""
    counts: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        first = stack.split(";")[0]
        if first.startswith("thread ("):
            counts[first.split(": ", 1)[-1]] += int(count)
    total = sum(counts.values())
    return {name: round(n / total, 4) for name, n in counts.most_common()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_summary", description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path, help="py-spy raw output")
    parser.add_argument("--out", type=Path, help="write the shares here as JSON")
    parser.add_argument("--thread", help="that thread's samples only (a profile recorded with --threads)")
    parser.add_argument("--functions", choices=list(FUNCTION_SETS), default="batch-workers",
                        help="the functions whose inclusive shares are listed")
    args = parser.parse_args(argv)
    lines = args.raw.read_text().splitlines()
    total, found = shares(lines, FUNCTION_SETS[args.functions], args.thread)
    report: dict[str, object] = {"samples": total, "inclusive_share": found}
    if args.thread is not None:
        report["thread"] = args.thread
        report["self_share"] = self_shares(lines, args.thread)
    elif threads := thread_shares(lines):
        report["thread_share"] = threads
    emit_json(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
