"""Where one decoder step spends its time: onnxruntime's profiler, per operator type.

    python -m bench.decoder_profile --model models/translate-en-it --out bench/results/decoder_profile_cpu.json

Runs `--steps` decoder steps of a `--batch` x 1 batch after `--past` cached positions (sources
of `--source-len` tokens) on the CPU and writes the mean time per step of each operator type.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine


def profile(model_dir: Path, batch: int, past: int, source_len: int, steps: int, variant: str | None,
            threads: int = 0) -> dict[str, Any]:
    """Per operator type: mean milliseconds per decoder step and share of the step."""
    from service import runtime as runtime_module

    prefix = str(Path(tempfile.mkdtemp()) / "onnxruntime")
    runtime = runtime_module.ModelRuntime.load(model_dir, providers=["CPUExecutionProvider"], variant=variant,
                                               threads=threads, profile_prefix=prefix)
    state = runtime.encode(runtime.pad([[5] * (source_len - 1) + [runtime.eos_id]] * batch))
    shape = (batch, runtime.n_heads, past, runtime.head_dim)
    cache = runtime_module.KVCache([np.zeros(shape, np.float32)] * runtime.n_decoder_layers,
                                   [np.zeros(shape, np.float32)] * runtime.n_decoder_layers)
    last = np.full((batch, 1), runtime.bos_id, dtype=np.int64)
    positions = np.full((batch, 1), past, dtype=np.int64)
    mask = np.ones((batch, past + 1), dtype=bool)
    for _ in range(steps):
        runtime.decode(last, state, cache, positions=positions, target_mask=mask)
    events = json.loads(Path(runtime.decoder.end_profiling()).read_text(encoding="utf-8"))
    runtime.encoder.end_profiling()
    return {"variant": runtime.variant, **op_times(events, steps)}


def op_times(events: list[dict[str, Any]], calls: int, top_nodes: int = 12) -> dict[str, Any]:
    """From one session's onnxruntime profile: per operator type, mean milliseconds per call
    (`calls` of the session) and share of the operators' time; `step_ms`, their sum per call;
    `nodes_per_step`, the kernels run per call on each execution provider, and
    `memcpy_per_step`, the host <-> device copies (Memcpy nodes) among them; `nodes`, the
    `top_nodes` single nodes that took longest, with their operator type."""
    per_op: Counter[str] = Counter()
    per_node: Counter[str] = Counter()
    node_op: dict[str, str] = {}
    per_provider: Counter[str] = Counter()
    copies = 0
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            args = event["args"]
            per_op[args["op_name"]] += event["dur"]
            node = event["name"].removesuffix("_kernel_time")
            per_node[node] += event["dur"]
            node_op[node] = args["op_name"]
            per_provider[args.get("provider", "?")] += 1
            copies += "Memcpy" in args["op_name"]
    total = sum(per_op.values()) or 1
    calls = max(calls, 1)
    return {
        "step_ms": round(total / calls / 1000, 3),
        "nodes_per_step": {provider: round(count / calls, 1) for provider, count in per_provider.most_common()},
        "memcpy_per_step": round(copies / calls, 2),
        "ops": {op: {"ms_per_step": round(us / calls / 1000, 3), "share": round(us / total, 3)}
                for op, us in per_op.most_common()},
        "nodes": {node: {"op": node_op[node], "ms_per_step": round(us / calls / 1000, 3), "share": round(us / total, 3)}
                  for node, us in per_node.most_common(top_nodes)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/decoder_profile_cpu.json"))
    parser.add_argument("--variant", default=None, help="default: the CPU's preferred variant (int8)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--past", type=int, default=30)
    parser.add_argument("--source-len", type=int, default=31)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: onnxruntime's default)")
    args = parser.parse_args(argv)
    result = profile(args.model, args.batch, args.past, args.source_len, args.steps, args.variant, args.threads)
    result.update(command="python -m bench.decoder_profile " + shlex.join(sys.argv[1:] if argv is None else argv),
                  batch=args.batch, past=args.past, source_len=args.source_len, threads=args.threads,
                  machine=machine.describe())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for op, values in list(result["ops"].items())[:10]:
        print(f"{op:28s} {values['ms_per_step']:.2f} ms/step {100 * values['share']:.0f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
