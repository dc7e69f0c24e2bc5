"""Sampled translation in-process against CTranslate2's, in alternating turns.

Back-translation and data augmentation sample their outputs rather than take the most likely;
both engines offer it (ours: `service.generation.sampling`; CTranslate2: `translate_batch`'s
`sampling_topk`, `sampling_topp` and `sampling_temperature`). Each turn runs the same sentences
greedy and at each sampling setting through our running batch (a point of `bench.in_process`)
and through CTranslate2 int8 at one setting of its grid (`bench.ctranslate2_runs`), in
alternating order (A B C D, D C B A, ...). Reported: each arm's sentences/s per turn, our
throughput over CTranslate2's per setting, what sampling costs each engine against its own
greedy runs, and the BLEU and mean output length of each arm's first turn (sampling lowers
BLEU: the outputs are draws, not the most likely translation).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import machine
from bench.in_process import load_runtime, parse_settings, run_settings
from bench.workload import SPLITS, read_lines
from service.generation.sampling import Sampling

logger = logging.getLogger(__name__)

OURS, THEIRS = "ours", "CTranslate2"
GREEDY = "greedy"


def parse_sampling(text: str) -> Sampling:
    """`TEMPERATURE:TOP_K:TOP_P` (top_k 0: no limit; e.g. `1.0:10:1.0`) as settings."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"expected TEMPERATURE:TOP_K:TOP_P, got {text!r}")
    temperature, top_k, top_p = float(parts[0]), int(parts[1]), float(parts[2])
    return Sampling(temperature, top_k or None, top_p, seed=0)


def label(sampling: Sampling | None) -> str:
    """An arm's name for its decoding."""
    if sampling is None:
        return GREEDY
    return f"t{sampling.temperature:g} k{sampling.top_k or 0} p{sampling.top_p:g}"


def ctranslate2_options(sampling: Sampling | None) -> dict[str, Any]:
    """`translate_batch`'s options for the same draw: top-k 0 is its whole vocabulary."""
    if sampling is None:
        return {}
    return {"sampling_temperature": sampling.temperature, "sampling_topk": sampling.top_k or 0,
            "sampling_topp": sampling.top_p}


def run(arms: dict[str, Callable[[], tuple[float, list[str]]]], count: int) -> tuple[dict[str, list[float]], dict[str, list[str]]]:
    """Each arm once per turn, the order reversed every other turn: each arm's sentences/s per
    turn and its first turn's outputs."""
    rates: dict[str, list[float]] = {name: [] for name in arms}
    first: dict[str, list[str]] = {}
    for turn in range(count):
        for name in (list(arms) if turn % 2 == 0 else list(arms)[::-1]):
            rate, texts = arms[name]()
            rates[name].append(round(rate, 1))
            first.setdefault(name, texts)
            logger.info("turn %d %s: %.1f sentences/s", turn + 1, name, rate)
    return rates, first


def summary(rates: dict[str, list[float]], outputs: dict[str, list[str]], references: list[str],
            settings: Sequence[Sampling | None]) -> dict[str, Any]:
    """Medians, our throughput over CTranslate2's per decoding (per turn and median), sampling's
    cost against greedy per engine (median of the per-turn ratios), BLEU and mean length."""
    from model.evaluation import translation_scores

    result: dict[str, Any] = {"sentences_per_s": rates,
                              "median": {name: statistics.median(values) for name, values in rates.items()},
                              "ours_over_ctranslate2": {}, "over_greedy": {}, "quality": {}}
    for sampling in settings:
        name = label(sampling)
        per_turn = [round(o / c, 3) for o, c in zip(rates[f"{OURS} {name}"], rates[f"{THEIRS} {name}"], strict=True)]
        result["ours_over_ctranslate2"][name] = {"per_turn": per_turn, "median": statistics.median(per_turn)}
        if sampling is not None:
            for engine in (OURS, THEIRS):
                ratios = [round(s / g, 3) for s, g in zip(rates[f"{engine} {name}"], rates[f"{engine} {GREEDY}"], strict=True)]
                result["over_greedy"][f"{engine} {name}"] = statistics.median(ratios)
    for name, texts in outputs.items():
        result["quality"][name] = {**translation_scores(texts, references),
                                   "mean_words": round(sum(len(t.split()) for t in texts) / len(texts), 2)}
    return result


def markdown(result: dict[str, Any]) -> str:
    """The run as a markdown report."""
    lines = ["# Sampled translation: our running batch and CTranslate2 in alternating turns", "",
             f"Command: `{result['command']}`", "",
             (f"{result['sentences']} sentences of the {result['split']} set, {result['turns']} turns; ours "
             f"`{result['point']}` (engine:rows:replicas:threads[:join_at]), CTranslate2 int8 {result['ctranslate2_setting']}."), "",
             "| arm | sentences/s, median (range) | per turn | BLEU (first turn) | chrF | words per output |",
             "|---|---|---|---|---|---|"]
    for name, values in result["sentences_per_s"].items():
        quality = result["quality"][name]
        lines.append(f"| {name} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) | "
                     f"{', '.join(f'{v:.1f}' for v in values)} | {quality['bleu']:.2f} | {quality['chrf']:.2f} | "
                     f"{quality['mean_words']:.2f} |")
    lines += ["", "| decoding | ours / CTranslate2, per turn | median |", "|---|---|---|"]
    for name, ratio in result["ours_over_ctranslate2"].items():
        lines.append(f"| {name} | {', '.join(map(str, ratio['per_turn']))} | **{ratio['median']:.3f}** |")
    lines += ["", "| arm | sampled / its engine's greedy throughput (median of turns) |", "|---|---|"]
    lines += [f"| {name} | {ratio:.3f} |" for name, ratio in result["over_greedy"].items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.sampling`: greedy and sampled translation, ours and CTranslate2's, in turns."""
    parser = argparse.ArgumentParser(prog="python -m bench.sampling", description=main.__doc__)
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--split", choices=SPLITS, default="test")
    parser.add_argument("--point", default="running-sorted:64:2:1:16",
                        help="ours: ENGINE:SIZE:REPLICAS:THREADS[:JOIN_AT] (default: the best in-process point)")
    parser.add_argument("--ctranslate2-setting", nargs=4, metavar=("REPLICAS", "THREADS", "BATCH", "TYPE"),
                        default=["2", "1", "1024", "tokens"], help="CTranslate2's point (its grid's best on 2 cores)")
    parser.add_argument("--sampling", nargs="+", default=["1.0:10:1.0", "0.9:0:0.9"],
                        help="TEMPERATURE:TOP_K:TOP_P each (top_k 0: no limit)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        point = parse_settings(args.point)
        samplings: list[Sampling | None] = [None, *(parse_sampling(text) for text in args.sampling)]
    except ValueError as exc:
        parser.error(str(exc))
    import sentencepiece as spm

    from bench import ctranslate2_converter, ctranslate2_runs
    from bench import workload as workload_module
    from model.tokenizer import Tokenizer
    from service.repository.manifest import read_manifest

    manifest = read_manifest(args.model)
    tokenizer = Tokenizer.from_file(args.model / "tokenizer.model")
    pieces_model = spm.SentencePieceProcessor(model_file=str(args.model / "tokenizer.model"))
    work = workload_module.load(args.data_dir, args.model.name, manifest.task, tokenizer, manifest.max_source_len,
                                args.sentences, args.split)
    references = read_lines(args.data_dir / args.model.name / f"{args.split}.tgt", args.sentences)
    replicas, threads, batch, batch_type = args.ctranslate2_setting
    setting = ctranslate2_runs.Ct2Settings(int(replicas), int(threads), int(batch), batch_type)
    runtime = load_runtime(args.model, point.threads)
    pieces = [tokenizer.pieces(ids) for ids in work.source_ids]
    limit = manifest.max_target_len
    with tempfile.TemporaryDirectory(prefix="ct2-") as scratch:
        translator = ctranslate2_runs.load_translator(
            ctranslate2_converter.convert(args.model, Path(scratch) / "ctranslate2"), "int8",
            threads=setting.intra_threads, inter_threads=setting.inter_threads)

        def ours(sampling: Sampling | None) -> Callable[[], tuple[float, list[str]]]:
            def arm() -> tuple[float, list[str]]:
                stats, results = run_settings(runtime, work.source_ids, point, limit, sampling)
                return stats.sentences_per_s, [tokenizer.decode(r.tokens) for r in results]
            return arm

        def theirs(sampling: Sampling | None) -> Callable[[], tuple[float, list[str]]]:
            def arm() -> tuple[float, list[str]]:
                stats, outputs = ctranslate2_runs.run_batch(
                    translator, pieces, 1, limit, setting.max_batch_size, setting.batch_type, **ctranslate2_options(sampling))
                return stats.sentences_per_s, [str(pieces_model.decode_pieces(list(o))).strip() for o in outputs]
            return arm

        arms: dict[str, Callable[[], tuple[float, list[str]]]] = {}
        for sampling in samplings:
            arms[f"{OURS} {label(sampling)}"] = ours(sampling)
            arms[f"{THEIRS} {label(sampling)}"] = theirs(sampling)
        rates, outputs = run(arms, args.turns)
    result = summary(rates, outputs, references, samplings)
    result.update(command=shlex.join(["python", "-m", "bench.sampling", *(sys.argv[1:] if argv is None else argv)]),
                  machine=machine.describe(), split=args.split, sentences=len(work), turns=args.turns,
                  point=args.point, ctranslate2_setting=setting.to_dict())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampling.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (args.out / "sampling.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise SystemExit(main())
