"""A vocabulary shortlist for the int8 decoder step: coverage of the lexical table, BLEU and
speed of greedy decoding through one `SlotBatch` with the whole vocabulary and with the shortlist.

    python -m bench.shortlist --model models/translate-en-it --data-dir data/translate-en-it --out bench/results/shortlist

Coverage: the table is built from the training pairs (`export.shortlist`) for each score, K
(candidates per source piece) and N (most frequent target pieces); for each test pair, the
share of its reference tokens in its own source's shortlist (and of the full-vocabulary greedy
outputs' tokens, on the BLEU rows, for the chosen table). A batch's shortlist is the union of its
rows', so these are lower bounds for a batch.

BLEU: the first `--bleu-sentences` test sources replayed through one `SlotBatch` of up to
`--rows` rows (int8, one intra-op thread; `--group` newcomers join whenever a row is free), once
with the whole vocabulary and once with the chosen table's shortlist; sacreBLEU as
`export.quality` scores it, and the share of identical outputs.

Step calls: one decoder step of `--rows` rows called alone, the step graph and the shortlist
graph (every id, the shortlist of the first `--rows` test sources, 1,500 random ids or
3/16 of a smaller vocabulary), one call
of each per round: the step's cost without the replay's bookkeeping.

Speed: the first `--speed-sentences` test sources replayed the same way, the two variants in
alternating turns (A B B A A B ...), `--turns` each; per turn the seconds in decoder steps
(`generate_token`) and in the whole replay (joins included), wall clock and CPU time.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine

FULL, SHORT = "full vocabulary", "shortlist"


def replay(runtime: Any, sources: list[list[int]], rows: int, group: int,
           shortlist: bool) -> tuple[list[list[int]], dict[str, float]]:
    """Each source's greedy tokens through one `SlotBatch` (newcomers join `group` at a time
    while fewer than `rows` rows decode; one step after each join check), and the seconds in
    steps and in the whole replay (wall clock, and this process's CPU time: with one intra-op
    thread the graph runs in this thread, so CPU time is what other jobs on the machine disturb
    least); the mean shortlist size over the steps that used one."""
    from service.batching.slot_batch import SlotBatch

    batch: SlotBatch[int] = SlotBatch(runtime, scores=False, rows=rows, shortlist_rows=rows if shortlist else 0)
    outputs: list[list[int]] = [[] for _ in sources]
    steps_s = steps_cpu = 0.0
    steps = 0
    sizes: list[int] = []
    index = 0
    started, started_cpu = time.perf_counter(), time.process_time()
    while index < len(sources) or len(batch):
        if index < len(sources) and len(batch) < rows:
            newcomers = sources[index:index + group]
            batch.concatenate(newcomers, list(range(index, index + len(newcomers))),
                              [runtime.max_target_len] * len(newcomers))
            index += len(newcomers)
        if shortlist:
            vocab = batch.step_vocab()
            sizes.append(len(vocab) if vocab is not None else runtime.vocab_size)
        begun_cpu = time.process_time()  # outside the wall-clock window: reading it is not free
        begun = time.perf_counter()
        for owner, result in batch.generate_token():
            outputs[owner] = result.tokens
        steps_s += time.perf_counter() - begun
        steps_cpu += time.process_time() - begun_cpu
        steps += 1
    total, total_cpu = time.perf_counter() - started, time.process_time() - started_cpu
    timing = {"step_s": round(steps_s, 3), "replay_s": round(total, 3), "step_cpu_s": round(steps_cpu, 3),
              "replay_cpu_s": round(total_cpu, 3), "steps": steps}
    if sizes:
        timing["mean_shortlist"] = round(float(np.mean(sizes)), 1)
    return outputs, timing


def step_calls(runtime: Any, shortlist: Any, vocabularies: dict[str, Any], rows: int, rounds: int,
               seed: int = 0) -> dict[str, dict[str, float]]:
    """Milliseconds per call of one decoder step of `rows` rows (source width 32, 16 cached
    positions, random inputs): the step graph (`vocabularies` value None) and the shortlist's
    step graph for each named vocabulary (its projection columns made beforehand, once, as a
    batch makes them per new shortlist), one call of each per round, the order reversed every
    other round; the median and the fastest call of each."""
    from service.runtime.step_buffers import CacheBuffers, run_step

    rng = np.random.default_rng(seed)
    heads, head_dim, layers = runtime.n_heads, runtime.head_dim, runtime.n_decoder_layers
    cross = [rng.standard_normal((rows, heads, 32, head_dim)).astype(np.float32) for _ in range(2 * layers)]
    mask = np.ones((rows, 32), dtype=bool)
    ids = rng.integers(4, runtime.vocab_size, (rows, 1))
    positions = np.full((rows, 1), 16, dtype=np.int64)
    buffers = CacheBuffers(layers, rows, heads, 32, head_dim)
    for array in buffers.arrays:
        array[:] = rng.standard_normal(array.shape)
    columns = {name: None if vocab is None else shortlist.columns(vocab) for name, vocab in vocabularies.items()}
    times: dict[str, list[float]] = {name: [] for name in vocabularies}
    names = list(vocabularies)
    for turn in range(rounds + 1):
        for name in names if turn % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            run_step(runtime.step if columns[name] is None else shortlist.session, ids, positions, mask, cross,
                     buffers, columns[name])
            if turn:  # the first round warms up
                times[name].append(time.perf_counter() - started)
    return {name: {"median_ms": round(1000 * statistics.median(t), 3), "min_ms": round(1000 * min(t), 3),
                   "columns": runtime.vocab_size if vocabularies[name] is None else len(vocabularies[name])}
            for name, t in times.items()}


def _coverage(args: argparse.Namespace, tokenizer: Any, test_sources: list[list[int]],
              test_targets: list[list[int]]) -> tuple[dict[str, Any], Any]:
    """Coverage of every (score, K, N) on the test split; the chosen table."""
    from export.shortlist import cooccurrence, top_candidates
    from model.run_config import read_split
    from service.runtime.shortlist import ShortlistTable

    train_src, train_tgt = read_split(args.data_dir, "train")
    started = time.perf_counter()
    src_ids, tgt_ids = tokenizer.encode_batch(train_src), tokenizer.encode_batch(train_tgt)
    counts, source_df, target_df, target_tf = cooccurrence(src_ids, tgt_ids, tokenizer.vocab_size)
    build_s = time.perf_counter() - started
    specials = np.asarray([tokenizer.eos_id, tokenizer.unk_id], dtype=np.int64)
    by_frequency = np.argsort(-target_tf, kind="stable")
    from export.shortlist import coverage

    rows: list[dict[str, Any]] = []
    chosen = None
    for score in args.scores:
        ranked = top_candidates(counts, source_df, target_df, len(src_ids), max(args.k), score)
        for k in args.k:
            for n in args.n:
                table = ShortlistTable(ranked[:, :k], np.unique(np.concatenate([by_frequency[:n], specials])))
                row = {"score": score, "k": k, "n": n, **coverage(table, test_sources, test_targets)}
                rows.append({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()})
                print(json.dumps(rows[-1]), flush=True)
                if (score, k, n) == (args.score, args.chosen_k, args.chosen_n):
                    chosen = table
    if chosen is None:
        ranked = top_candidates(counts, source_df, target_df, len(src_ids), args.chosen_k, args.score)
        chosen = ShortlistTable(ranked, np.unique(np.concatenate([by_frequency[:args.chosen_n], specials])))
    return {"train_pairs": len(src_ids), "cooccurrence_s": round(build_s, 1), "test_pairs": len(test_sources),
            "grid": rows}, chosen


def _markdown(results: dict[str, Any]) -> str:
    lines = ["# Vocabulary shortlist for the int8 decoder step", "",
             f"Command: `{results['command']}`", "",
             (f"Machine: {results['machine'].get('cpu', '')}, {results['machine'].get('cpu_count', '')} cores "
              "(shared with other jobs)"), ""]
    chosen = results["chosen"]
    lines += [f"Chosen table: score {chosen['score']}, K={chosen['k']}, N={chosen['n']}.", ""]
    cov = results.get("coverage")
    if cov:
        lines += ["## Coverage (test references' tokens in their own source's shortlist)", "",
                  f"{cov['test_pairs']} test pairs, table from {cov['train_pairs']} training pairs.", "",
                  "| score | K | N | token coverage | references held whole | mean shortlist |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['score']} | {r['k']} | {r['n']} | {r['token_coverage']:.4f} | {r['sentence_coverage']:.4f} | "
                  f"{r['mean_shortlist']:.0f} |" for r in cov["grid"]]
        lines.append("")
    bleu = results.get("bleu")
    if bleu:
        lines += [f"## BLEU, greedy through one SlotBatch (int8, first {bleu['sentences']} test sentences)", "",
                  "| vocabulary | BLEU | chrF |", "|---|---|---|",
                  f"| full | {bleu[FULL]['bleu']} | {bleu[FULL]['chrf']} |",
                  f"| shortlist | {bleu[SHORT]['bleu']} | {bleu[SHORT]['chrf']} |", "",
                  (f"Identical outputs: {bleu['identical']:.4f}. Full-vocabulary output tokens held by their own "
                   f"source's shortlist: {bleu['output_token_coverage']:.4f}."), ""]
    calls = results.get("calls")
    if calls:
        lines += [f"## One decoder step of {calls['rows']} rows, {calls['rounds']} calls each (interleaved)", "",
                  "| graph / vocabulary | columns | median ms | fastest ms |", "|---|---|---|---|"]
        lines += [f"| {name} | {v['columns']} | {v['median_ms']:.2f} | {v['min_ms']:.2f} |"
                  for name, v in calls["variants"].items()]
        lines.append("")
    speed = results.get("speed")
    if speed:
        lines += [(f"## Speed: {speed['sentences']} test sources, one SlotBatch of up to {speed['rows']} rows, "
                   "one intra-op thread"), "",
                  "| turn | variant | decoder steps s | whole replay s | steps CPU s | replay CPU s | steps | mean shortlist |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {i + 1} | {t['variant']} | {t['step_s']:.2f} | {t['replay_s']:.2f} | {t['step_cpu_s']:.2f} | "
                  f"{t['replay_cpu_s']:.2f} | {t['steps']} | {t.get('mean_shortlist', '-')} |"
                  for i, t in enumerate(speed["turns"])]
        lines += ["", "| variant | median steps s | median replay s | median steps CPU s | median replay CPU s |",
                  "|---|---|---|---|---|"]
        lines += [f"| {name} | {m['step_s']:.2f} | {m['replay_s']:.2f} | {m['step_cpu_s']:.2f} | {m['replay_cpu_s']:.2f} |"
                  for name, m in speed["median"].items()]
        lines += ["", f"Identical outputs over the speed runs: {speed['identical']:.4f}.", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, required=True, help="folder of {train,test}.{src,tgt}")
    parser.add_argument("--out", type=Path, default=Path("bench/results/shortlist"))
    parser.add_argument("--scores", nargs="*", default=["dice", "lift"])
    parser.add_argument("-k", type=int, nargs="*", default=[5, 10, 20, 50])
    parser.add_argument("-n", type=int, nargs="*", default=[100, 500, 1000])
    parser.add_argument("--score", default="dice", help="the chosen table's score")
    parser.add_argument("--chosen-k", type=int, default=20)
    parser.add_argument("--chosen-n", type=int, default=500)
    parser.add_argument("--bleu-sentences", type=int, default=500)
    parser.add_argument("--speed-sentences", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--group", type=int, default=4, help="sources per join")
    parser.add_argument("--turns", type=int, default=3, help="speed turns per variant")
    parser.add_argument("--calls", type=int, default=200, help="rounds of single step calls")
    parser.add_argument("--skip", nargs="*", default=[], choices=["bleu", "speed", "calls"])
    args = parser.parse_args(argv)
    from export.shortlist import (
        SHORTLIST_TABLE_FILE,
        save_table,
        write_shortlist_graphs,
    )
    from model.evaluation import translation_scores
    from model.run_config import read_split
    from model.tokenizer import Tokenizer
    from service.runtime import ModelRuntime
    from service.runtime.shortlist import Shortlist

    tokenizer = Tokenizer.from_file(args.model / "tokenizer.model")
    test_src, test_tgt = read_split(args.data_dir, "test")
    test_ids, ref_ids = tokenizer.encode_batch(test_src), tokenizer.encode_batch(test_tgt)
    results: dict[str, Any] = {
        "command": "python -m bench.shortlist " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine.describe(),
        "chosen": {"score": args.score, "k": args.chosen_k, "n": args.chosen_n},
    }
    results["coverage"], table = _coverage(args, tokenizer, test_ids, ref_ids)
    args.out.mkdir(parents=True, exist_ok=True)
    save_table(table, args.out / SHORTLIST_TABLE_FILE)

    def write() -> None:
        (args.out / "shortlist.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        (args.out / "shortlist.md").write_text(_markdown(results), encoding="utf-8")

    write()
    runtime = ModelRuntime.load(args.model, providers=["CPUExecutionProvider"], threads=1, spinning=False,
                                memory_arena=False, variant="int8")
    assert runtime.manifest.variants["int8"].step_decoder
    with tempfile.TemporaryDirectory() as scratch:
        graph, projection = write_shortlist_graphs(args.model / runtime.manifest.variants["int8"].step_decoder,
                                                   Path(scratch))
        shortlist = Shortlist.load(graph, projection, args.out / SHORTLIST_TABLE_FILE, threads=1, spinning=False,
                                   memory_arena=False)
    runtime.shortlist = shortlist
    keep, eos = runtime.max_source_len - 1, runtime.eos_id
    sources = [ids[:keep] + [eos] for ids in test_ids]
    if "bleu" not in args.skip:
        count = args.bleu_sentences
        outs = {name: replay(runtime, sources[:count], args.rows, args.group, name == SHORT)[0] for name in (FULL, SHORT)}
        bleu: dict[str, Any] = {"sentences": count}
        for name, tokens in outs.items():
            bleu[name] = translation_scores([tokenizer.decode(t) for t in tokens], test_tgt[:count])
        bleu["identical"] = sum(a == b for a, b in zip(outs[FULL], outs[SHORT], strict=True)) / count
        held = total = 0
        for source, output in zip(sources[:count], outs[FULL], strict=True):
            inside = np.isin(np.asarray(output + [eos], dtype=np.int64), table.shortlist([source]))
            held, total = held + int(inside.sum()), total + len(inside)
        bleu["output_token_coverage"] = held / max(total, 1)
        results["bleu"] = bleu
        print(json.dumps(bleu), flush=True)
        write()
    if "calls" not in args.skip:
        rng = np.random.default_rng(0)
        batch_vocab = table.shortlist(sources[:args.rows])
        few = min(1500, runtime.vocab_size * 3 // 16)
        vocabularies = {FULL: None, "shortlist graph, every id": np.arange(runtime.vocab_size, dtype=np.int64),
                        f"shortlist of the first {args.rows} test sources": batch_vocab,
                        f"{few} random ids": np.sort(rng.choice(runtime.vocab_size, few, replace=False)).astype(np.int64)}
        results["calls"] = {"rows": args.rows, "rounds": args.calls,
                            "variants": step_calls(runtime, shortlist, vocabularies, args.rows, args.calls)}
        print(json.dumps(results["calls"]), flush=True)
        write()
    if "speed" not in args.skip:
        count = args.speed_sentences
        order = [FULL, SHORT] if args.turns else []
        turns: list[dict[str, Any]] = []
        last: dict[str, list[list[int]]] = {}
        for turn in range(2 * args.turns):
            name = order[(turn + 1) // 2 % 2]  # A B B A A B ...
            tokens, timing = replay(runtime, sources[:count], args.rows, args.group, name == SHORT)
            last[name] = tokens
            turns.append({"variant": name, **timing})
            print(json.dumps(turns[-1]), flush=True)
        results["speed"] = {
            "sentences": count, "rows": args.rows, "group": args.group, "turns": turns,
            "median": {name: {key: statistics.median(t[key] for t in turns if t["variant"] == name)
                              for key in ("step_s", "replay_s", "step_cpu_s", "replay_cpu_s")} for name in order},
            "identical": sum(a == b for a, b in zip(last[FULL], last[SHORT], strict=True)) / count,
        }
        write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
