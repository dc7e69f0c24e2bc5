"""Word-alignment quality of cross-attention methods against the hand-made gold set.

The gold set (tests/fixtures/alignment: source lines of the test split, the model's own greedy
translations, sure links by hand) is split by line: even lines (0, 2, ...) are the dev half, on
which every candidate `Method` is scored and the best F1 chosen; odd lines are the test half,
which reports the chosen method and the baseline untouched by the choice; "all" is both.

Each pair's maps come from one teacher-forced pass of the target text, as `POST /v1/attention`
with a `target` computes them; the methods then run on those maps. Writes `<out>/alignment.json`
and `<out>/alignment.md`, both naming the command that produced them.

    python -m bench.alignment --model models/translate-en-it --out bench/results/alignment
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from service.generation.alignment import (
    BASELINE,
    DEFAULT,
    EXTRACTIONS,
    Method,
    Scores,
    align,
    parse_pharaoh,
    score,
)
from service.generation.search import teacher_forced_attention
from service.runtime import CPU, ModelRuntime

GOLD_DIR = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "alignment"
THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5)


@dataclass(frozen=True)
class GoldPair:
    """One pair of the gold set: source, target (the model's greedy output) and sure links."""

    source: str
    target: str
    links: set[tuple[int, int]]


@dataclass
class Pair:
    """A gold pair with its teacher-forced cross-attention and piece spans."""

    gold: GoldPair
    cross: np.ndarray  # (layers, heads, target pieces + 1, source pieces + 1)
    source_spans: list[tuple[int, int]]
    target_spans: list[tuple[int, int]]


def read_gold(directory: Path = GOLD_DIR) -> list[GoldPair]:
    """source.txt, target.txt and gold.talp of a gold folder, line by line."""
    sources = (directory / "source.txt").read_text(encoding="utf-8").splitlines()
    targets = (directory / "target.txt").read_text(encoding="utf-8").splitlines()
    links = (directory / "gold.talp").read_text(encoding="utf-8").splitlines()
    if not len(sources) == len(targets) == len(links):
        raise ValueError(f"{directory}: {len(sources)} sources, {len(targets)} targets, {len(links)} link lines")
    pairs = [GoldPair(s, t, parse_pharaoh(a)) for s, t, a in zip(sources, targets, links, strict=True)]
    for n, pair in enumerate(pairs):
        n_source, n_target = len(pair.source.split()), len(pair.target.split())
        bad = [(i, j) for i, j in pair.links if i >= n_source or j >= n_target]
        if bad:
            raise ValueError(f"{directory}: line {n + 1}: links {bad} outside {n_source}x{n_target} words")
    return pairs


def attend(runtime: ModelRuntime, gold: Sequence[GoldPair]) -> list[Pair]:
    """Every pair's cross-attention: one teacher-forced pass of its target text."""
    pairs = []
    tokenizer = runtime.tokenizer
    for pair in gold:
        source_ids, source_spans = tokenizer.encode_with_offsets(pair.source)
        target_ids, target_spans = tokenizer.encode_with_offsets(pair.target)
        maps = teacher_forced_attention(runtime, [*source_ids, runtime.eos_id], target_ids)
        pairs.append(Pair(pair, np.stack(maps.cross), source_spans, target_spans))
    return pairs


def predict(pairs: Sequence[Pair], method: Method) -> list[set[tuple[int, int]]]:
    """Each pair's links by `method`."""
    return [set(align(p.cross, p.gold.source, p.source_spans, p.gold.target, p.target_spans, method).links)
            for p in pairs]


def evaluate(pairs: Sequence[Pair], method: Method) -> Scores:
    """`method`'s scores over `pairs`."""
    return score(predict(pairs, method), [p.gold.links for p in pairs])


def candidates(n_layers: int, n_heads: int) -> list[Method]:
    """Every method tried: each layer alone, the last two (-2, -1) and all layers (None), heads
    averaged, and each single head; predicting and shifted rows; every extraction (thresholds
    of `THRESHOLDS`)."""
    groups: list[tuple[tuple[int, ...] | None, tuple[int, ...] | None]] = [
        ((layer,), None) for layer in range(n_layers)]
    groups += [((-2, -1), None), (None, None)]
    groups += [((layer,), (head,)) for layer in range(n_layers) for head in range(n_heads)]
    methods = []
    for layers, heads in groups:
        for shift in (False, True):
            for extraction in EXTRACTIONS:
                for threshold in THRESHOLDS if extraction == "threshold" else (0.0,):
                    methods.append(Method(layers, heads, shift, extraction, threshold))
    return methods


def split(pairs: Sequence[Pair]) -> dict[str, list[Pair]]:
    """dev (even lines), test (odd lines) and all."""
    return {"dev": list(pairs[0::2]), "test": list(pairs[1::2]), "all": list(pairs)}


def run(model_dir: Path, gold_dir: Path = GOLD_DIR, threads: int = 0, variant: str | None = None) -> dict:
    """Score every candidate on dev, choose the best F1, and score baseline, choice and the
    service's `DEFAULT` on dev, test and all."""
    runtime = ModelRuntime.load(model_dir, [CPU], threads=threads, variant=variant)
    pairs = attend(runtime, read_gold(gold_dir))
    halves = split(pairs)
    n_layers = runtime.n_decoder_layers
    dev_scores = [(method, evaluate(halves["dev"], method))
                  for method in candidates(n_layers, runtime.n_heads)]
    ranked = sorted(dev_scores, key=lambda item: -item[1].f1)
    chosen = ranked[0][0]
    report = {
        "model": runtime.name, "variant": runtime.variant, "provider": runtime.provider,
        "gold": {"pairs": len(pairs), "dev": len(halves["dev"]), "test": len(halves["test"]),
                 "sure_links": sum(len(p.gold.links) for p in pairs)},
        "chosen_on_dev": chosen.name,
        "service_default": DEFAULT.name,
        "results": {
            label: {"method": method.name,
                    **{half: asdict(evaluate(subset, method)) for half, subset in halves.items()}}
            for label, method in (("baseline", BASELINE), ("chosen", chosen), ("default", DEFAULT))
        },
        "dev_ranking": [{"method": m.name, **asdict(s)} for m, s in ranked[:25]],
        "dev_by_family": _families(dev_scores),
    }
    return report


def _families(dev_scores: Sequence[tuple[Method, Scores]]) -> list[dict]:
    """The best dev F1 of each (layers, heads averaged or one head, shift) family."""
    best: dict[str, tuple[Method, Scores]] = {}
    for method, scores in dev_scores:
        layers = "*" if method.layers is None else "+".join(map(str, method.layers))
        key = f"L{layers}/{'h*' if method.heads is None else 'one head'}/{'shift' if method.shift else 'predict'}"
        if key not in best or scores.f1 > best[key][1].f1:
            best[key] = (method, scores)
    return [{"family": key, "best": m.name, "f1": s.f1} for key, (m, s) in sorted(best.items())]


def markdown(report: dict, command: str) -> str:
    """The report as a markdown page."""
    lines = [
        "# Word alignment from cross-attention",
        "",
        f"Command: `{command}`",
        "",
        (f"Model `{report['model']}` ({report['variant']}, {report['provider']}); gold set "
        f"tests/fixtures/alignment: {report['gold']['pairs']} pairs, {report['gold']['sure_links']} sure links; "
        f"dev = even lines ({report['gold']['dev']}), test = odd lines ({report['gold']['test']}). "
        f"Chosen on dev: `{report['chosen_on_dev']}`; the service's default: `{report['service_default']}`."),
        ("Sure links only, so AER = 1 - F1. Methods: `L<layers>/h<heads>/<row>/<extraction>` "
        "(service/generation/alignment.py)."),
        "",
        "| method | split | precision | recall | F1 | AER |",
        "|---|---|---|---|---|---|",
    ]
    for label, result in report["results"].items():
        for half in ("dev", "test", "all"):
            s = result[half]
            lines.append(f"| {label} `{result['method']}` | {half} | {s['precision']:.3f} | "
                         f"{s['recall']:.3f} | {s['f1']:.3f} | {s['aer']:.3f} |")
    lines += ["", "Best dev F1 per family:", "", "| family | best method | dev F1 |", "|---|---|---|"]
    lines += [f"| {f['family']} | `{f['best']}` | {f['f1']:.3f} |" for f in report["dev_by_family"]]
    lines += ["", "Top of the dev ranking:", "", "| method | P | R | F1 |", "|---|---|---|---|"]
    lines += [f"| `{r['method']}` | {r['precision']:.3f} | {r['recall']:.3f} | {r['f1']:.3f} |"
              for r in report["dev_ranking"][:10]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--gold", type=Path, default=GOLD_DIR)
    parser.add_argument("--out", type=Path, default=Path("bench/results/alignment"))
    parser.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: default)")
    parser.add_argument("--variant", default=None, help="model variant (default: the one the service picks)")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "bench.alignment", *(sys.argv[1:] if argv is None else argv)])
    report = run(args.model, args.gold, args.threads, args.variant)
    report["command"] = command
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alignment.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (args.out / "alignment.md").write_text(markdown(report, command), encoding="utf-8")
    print(markdown(report, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
