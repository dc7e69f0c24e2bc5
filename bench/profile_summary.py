"""Inclusive shares of named functions in a sampling profile of the server (py-spy's raw
format: one `frame;frame;... count` line per distinct stack, `py-spy record -f raw`).

    py-spy record --native -r 50 -d 40 -p <server pid> -f raw -o profile.raw   # while loaded
    python -m bench.profile_summary profile.raw --out bench/results/profile/c64.json

A function's share is the fraction of samples (over all the server's threads) whose stack
contains it, counted once per sample however deep it recurs. A profile recorded with py-spy's
`--threads` (each stack's first frame names its thread) also gives each thread's share.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

# what the report lists: the batch workers' stepping, the model calls, the slot bookkeeping,
# and the event loop's request handling
FUNCTIONS = (
    "Stepper._step_until_interrupted", "SlotBatch.generate_token", "SlotBatch.concatenate",
    "HostSlots.step", "run_step", "Session.run_with_iobinding", "ModelRuntime.encode",
    "SlotBatch._remove", "SlotBatch._shrink", "SlotBatch._resize", "HostSlots.move_rows", "StepBinding.__init__",
    "choose", "advance",
    "Runner.run", "RequestResponseCycle.run_asgi", "_generate", "prepare", "outputs",
)


def shares(lines: list[str], functions: tuple[str, ...] = FUNCTIONS) -> tuple[int, dict[str, float]]:
    """Total samples and each function's inclusive share of them."""
    total = 0
    counts: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        names = {frame.split(" (")[0] for frame in stack.split(";")}
        for name in names:
            counts[name] += n
    return total, {name: round(counts[name] / max(total, 1), 4) for name in functions}


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
    args = parser.parse_args(argv)
    lines = args.raw.read_text().splitlines()
    total, found = shares(lines)
    report: dict[str, object] = {"samples": total, "inclusive_share": found}
    if threads := thread_shares(lines):
        report["thread_share"] = threads
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
