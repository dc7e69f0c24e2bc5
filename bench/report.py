"""Write the results: `<name>.json`, a markdown table `<name>.md`, and a plot per task `<name>-<task>.png`."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

COLUMNS = ("sentences/s", "target tokens/s", "p50 s", "p95 s", "p99 s", "errors")


def stats_rows(node: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every run (a dict with `sentences_per_s`) under `node`, with its path joined by ' / '."""
    if "sentences_per_s" in node:
        yield " / ".join(path), node
        return
    for key, value in node.items():
        if isinstance(value, dict):
            yield from stats_rows(value, (*path, key))


def _cell(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown: header facts, one table per task, the targets table."""
    lines = [f"# Benchmark `{results.get('name', '')}`", ""]
    if results.get("label"):
        lines += [f"**{results['label']}**", ""]
    if results.get("command"):
        lines += [f"Command: `{results['command']}`", ""]
    machine = results.get("machine", {})
    if machine:
        facts = (f"Machine: {machine.get('cpu')}, {machine.get('cpu_count')} cores, load "
                 f"{machine.get('load_average_1m')} (1 min) at the start")
        lines += [facts, ""]
    for task, task_results in results.get("tasks", {}).items():
        lines += [f"## {task} ({task_results.get('sentences', '?')} inputs of the {task_results.get('split', 'test')} set)", "",
                  "| run | " + " | ".join(COLUMNS) + " |", ("|---" * (len(COLUMNS) + 1)) + "|"]
        for name, row in stats_rows({k: v for k, v in task_results.items() if isinstance(v, dict)}):
            cells = [row.get("sentences_per_s"), row.get("tokens_per_s"), row.get("latency_p50_s"),
                     row.get("latency_p95_s"), row.get("latency_p99_s"), row.get("errors")]
            lines.append(f"| {name} | " + " | ".join(_cell(c) for c in cells) + " |")
        turns = task_results.get("service_open_turns", [])
        if turns:
            lines += ["", (f"Open loops in {len(turns)} turns, each at 70% of the dynamic server's throughput "
                           "measured at its start, dynamic and continuous batching alternating in slices (the same "
                           "arrivals for both, each mode's slices pooled); the open rows above are the turn with "
                           "the median ratio:"), "",
                      ("| turn | offered requests/s | dynamic p95 s | continuous p95 s | continuous / dynamic "
                       "| slices with the lower p95 continuous |"),
                      "|---|---|---|---|---|---|"]
            lines += [f"| {i} | {_cell(t['offered_rate'], 2)} | {_cell(t['dynamic_p95_s'])} | "
                      f"{_cell(t['continuous_p95_s'])} | {_cell(t['p95_ratio'], 2)} | "
                      f"{t.get('slices_continuous_lower', '-')} of {t.get('slices', '-')} |"
                      for i, t in enumerate(turns, 1)]
        lines += in_process_grid_table(task_results.get("in_process", {}))
        lines += grid_table(task_results.get("ctranslate2", {}))
        lines += roofline_lines(task_results.get("roofline", {}))
        for key, value in task_results.items():
            if key.startswith("agreement"):
                lines.append("")
                lines.append(f"{key}: {_cell(value * 100 if isinstance(value, float) else value, 1)}%")
        lines.append("")
    failures = results.get("failures", {})
    if failures:
        lines += ["## Failed steps", ""] + [f"- {step}: {error}" for step, error in failures.items()] + [""]
    servers = results.get("servers", {})
    if servers:
        lines += ["## Peak RSS of each server process", "", "| server | peak RSS MB | models |", "|---|---|---|"]
        for name, values in servers.items():
            models = ", ".join(f"{m}: {v}" for m, v in values.get("variants", {}).items())
            lines.append(f"| {name} | {_cell(values.get('peak_rss_mb'), 1)} | {models or '-'} |")
        lines.append("")
    targets = results.get("targets", [])
    if targets:
        lines += ["## Targets", "", "| target | measured ratio | bound | status | note |", "|---|---|---|---|---|"]
        for t in targets:
            bound = ("≥ " if t["at_least"] else "≤ ") + _cell(t["bound"], 2)
            lines.append(f"| {t['description']} | {_cell(t['ratio'], 3)} | {bound} | {t['status']} | {t['note']} |")
        lines.append("")
    return "\n".join(lines)


def _points_table(points: list[dict[str, Any]], intro: str, columns: list[str],
                  cells: Callable[[dict[str, Any]], list[Any]]) -> list[str]:
    """A tuning grid as markdown lines: `intro`, then one row of `cells` per point, the one of
    the highest sentences/s marked best."""
    best = max(p["sentences_per_s"] for p in points)
    lines = ["", intro, "", "| " + " | ".join(columns) + " | |", "|---" * (len(columns) + 1) + "|"]
    for point in points:
        mark = "best" if point["sentences_per_s"] == best else ""
        lines.append("| " + " | ".join(str(c) for c in cells(point)) + f" | {mark} |")
    return lines


def in_process_grid_table(in_process: dict[str, Any]) -> list[str]:
    """Our in-process tuning grid as markdown lines: every point, the best marked (none without a grid)."""
    points = in_process.get("grid", [])
    if not points:
        return []
    return _points_table(points, ("ONNX in-process over its tuning grid (`batches`: request-level batches of similar "
                                  "length; `running`: a running batch of that many slots, taking the sentences in order; "
                                  "`running-sorted`: the same, shortest first; join at: newcomers take the free slots "
                                  "once that many are free; the best point is compared in the targets):"),
                         ["engine", "size", "replicas", "threads", "join at", "sentences/s", "p50 s"],
                         lambda p: [p["settings"]["engine"], p["settings"]["size"], p["settings"]["replicas"],
                                    p["settings"]["threads"],
                                    p["settings"].get("join_at", 1) if p["settings"]["engine"] != "batches" else "",
                                    _cell(p["sentences_per_s"]), _cell(p["latency_p50_s"])])


def grid_table(ct2: dict[str, Any]) -> list[str]:
    """CTranslate2's tuning grid as markdown lines: every point, the best marked (none without a grid)."""
    points = ct2.get("int8_greedy_grid", [])
    if not points:
        return []
    lines = _points_table(points, ("CTranslate2 int8 greedy `translate_batch` over its tuning grid (the best point "
                                   "is the baseline of the targets):"),
                          ["replicas (inter_threads)", "intra_threads", "batch", "sentences/s"],
                          lambda p: [p["settings"]["inter_threads"], p["settings"]["intra_threads"],
                                     f"{p['settings']['max_batch_size']} {p['settings']['batch_type']}",
                                     _cell(p["sentences_per_s"])])
    singles = ct2.get("int8_greedy_single_grid", [])
    if singles:
        lowest = min(p["latency_p50_s"] for p in singles)
        lines += ["", "| single sentence: replicas | intra_threads | p50 s | |", "|---|---|---|---|"]
        lines += [f"| {p['settings']['inter_threads']} | {p['settings']['intra_threads']} | "
                  f"{_cell(p['latency_p50_s'])} | {'best' if p['latency_p50_s'] == lowest else ''} |" for p in singles]
    return lines


def roofline_lines(roofline: dict[str, Any]) -> list[str]:
    """The roofline as markdown lines: FLOPs per sentence, the ceilings, each system's share."""
    if not roofline:
        return []
    shares = ", ".join(f"{name} {_cell(100 * roofline[f'{name}_fraction_int8'], 1)}%"
                       for name in ("service", "in_process", "ctranslate2")
                       if roofline.get(f"{name}_fraction_int8") is not None)
    return ["", (f"Roofline: {roofline['flops_per_sentence'] / 1e6:.1f} MFLOP per sentence (matrix multiplications, "
                 f"{roofline['mean_target_tokens']} target tokens); matrix-multiply peak at the model's shapes "
                 f"{_cell(roofline['int8']['peak_gflops'], 1)} GFLOP/s int8, {_cell(roofline['fp32']['peak_gflops'], 1)} "
                 f"fp32; share of the int8 peak: {shares or '-'}.")]


def plot(task_results: dict[str, Any], title: str, path: Path) -> Path:
    """Throughput vs concurrency (service continuous/dynamic/no batching, baselines as lines) and latency
    percentiles vs concurrency, side by side, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    service = task_results.get("service", {})
    for mode, style in (("continuous", "-"), ("dynamic", "-."), ("batching_off", "--")):
        closed = service.get(mode, {}).get("closed", {})
        levels = sorted((int(k[1:]), v) for k, v in closed.items() if v.get("latency_p50_s") is not None)
        if not levels:
            continue
        xs = [c for c, _ in levels]
        throughput.plot(xs, [v["sentences_per_s"] for _, v in levels], style, marker="o", label=f"service {mode}")
        for point, color in (("latency_p50_s", "C0"), ("latency_p95_s", "C1"), ("latency_p99_s", "C2")):
            latency.plot(xs, [v[point] for _, v in levels], style, marker="o", color=color,
                         label=f"{mode} {point[8:11]}")
    baselines = {
        "CTranslate2 int8 batch": task_results.get("ctranslate2", {}).get("int8_greedy_batch"),
        "naive PyTorch c1": task_results.get("naive", {}).get("closed", {}).get("c1"),
    }
    in_process = [v for v in task_results.get("in_process", {}).values() if isinstance(v, dict)]
    if in_process:
        baselines["ONNX in-process best"] = max(in_process, key=lambda v: v["sentences_per_s"])
    for (name, run), color in zip(baselines.items(), ("C3", "C4", "C5"), strict=True):
        if run:
            throughput.axhline(run["sentences_per_s"], color=color, linestyle=":", label=name)
    throughput.set(xlabel="concurrent clients", ylabel="sentences/s", title=f"{title}: throughput")
    latency.set(xlabel="concurrent clients", ylabel="latency (s)",
                title=f"{title}: latency percentiles")
    if latency.lines:  # log axes need positive data
        for axis in (throughput, latency):
            axis.set_xscale("log")
        latency.set_yscale("log")
    for axis in (throughput, latency):
        axis.grid(True, which="both", alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def emit_json(report: dict[str, Any], out: Path | None) -> None:
    """Print `report` as indented JSON and, with `out`, write it there too (its folder made)."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")


def write(results: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    """Write the JSON, the markdown and one PNG per task into `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    md_path = out_dir / f"{name}.md"
    md_path.write_text(markdown(results), encoding="utf-8")
    paths = [json_path, md_path]
    for task, task_results in results.get("tasks", {}).items():
        paths.append(plot(task_results, task, out_dir / f"{name}-{task}.png"))
    return paths
