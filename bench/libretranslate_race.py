"""LibreTranslate's own server against this one, on the same model and through the same API
(`POST /translate`, one test sentence a request, closed loops at each concurrency).

LibreTranslate (Flask on waitress, argos-translate on CTranslate2) serves translate-en-it as an
argos-translate package (`argos_package`: the CTranslate2 int8 conversion of its checkpoint,
`bench.ctranslate2_converter`, with the source EOS the model was trained with, and its
SentencePiece model), greedy (`ARGOS_BEAM_SIZE=1`, as this server's `/translate` by default).
Its sentence splitter (MiniSBD) downloads a model on first use; without a network each text is
taken as one sentence, which costs LibreTranslate nothing (the test sentences are single
sentences; this server still runs its splitter). LibreTranslate runs from a virtual environment
of its own (`--libretranslate-python`; its pins conflict with ours):

    python -m venv .lt && .lt/bin/pip install libretranslate==1.9.6

Tuned as its users would tune it: every point of `GRID` (CTranslate2's inter and intra threads,
waitress's threads) at each concurrency, the best (most sentences/s; at one client the lowest
p50) then against this server's defaults in alternating turns. The share of identical
translations is measured on the first sentences, one at a time (LibreTranslate capitalizes a
translation's first letter after the source's, so both exact and first-letter-blind shares).

    python -m bench.libretranslate_race --libretranslate-python .lt/bin/python --models models \\
        --data-dir data --out bench/results/libretranslate
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench import load
from bench.ctranslate2_converter import convert
from bench.servers import HOST, ServerProcess, free_port, service_process

logger = logging.getLogger(__name__)

MODEL = "translate-en-it"
SOURCE, TARGET = "en", "it"
# LibreTranslate's settings tried: (ARGOS_INTER_THREADS, ARGOS_INTRA_THREADS, --threads);
# the first is its default.
GRID = ((1, 0, 4), (1, 2, 4), (2, 1, 4), (2, 1, 8), (1, 2, 8))
# What LibreTranslate runs: its splitter replaced (module docstring), then its own entry point.
LAUNCHER = (
    "import sys\n"
    "from argostranslate import sbd\n"
    "sbd.MiniSBDSentencizer.split_sentences = lambda self, text: [text]\n"
    "from libretranslate.main import main\n"
    "sys.argv = ['libretranslate', *sys.argv[1:]]\n"
    "main()\n"
)


def argos_package(model_dir: Path, out: Path) -> Path:
    """An installed argos-translate package of the translation model `model_dir` under `out`
    (the folder `ARGOS_PACKAGES_DIR` names): its packages folder."""
    package = out / f"translate-{SOURCE}_{TARGET}"
    if package.exists():
        shutil.rmtree(package)
    convert(model_dir, package / "model", "int8")
    config_path = package / "model" / "config.json"
    config = json.loads(config_path.read_text())
    config["add_source_eos"] = True  # argos-translate gives the pieces alone
    config_path.write_text(json.dumps(config, indent=2))
    shutil.copy(model_dir / "tokenizer.model", package / "sentencepiece.model")
    (package / "metadata.json").write_text(json.dumps({
        "package_version": "1.0", "argos_version": "1.0", "type": "translate",
        "from_code": SOURCE, "from_name": "English", "to_code": TARGET, "to_name": "Italian"}))
    return out


def libretranslate(python: str, packages: Path, home: Path, log_path: Path,
                   inter: int, intra: int, threads: int) -> ServerProcess:
    """LibreTranslate's server on a free port (not started) with one point of `GRID`."""
    port = free_port()
    command = [python, "-c", LAUNCHER, "--host", HOST, "--port", str(port), "--load-only",
               f"{SOURCE},{TARGET}", "--disable-web-ui", "--threads", str(threads)]
    env = {"HOME": str(home), "ARGOS_PACKAGES_DIR": str(packages), "ARGOS_DEVICE_TYPE": "cpu",
           "ARGOS_BEAM_SIZE": "1", "ARGOS_INTER_THREADS": str(inter),
           "ARGOS_INTRA_THREADS": str(intra)}
    return ServerProcess(command, port, log_path, env=env, ready_path="/languages")


def bodies(texts: Sequence[str]) -> list[dict[str, str]]:
    return [{"q": text, "source": SOURCE, "target": TARGET} for text in texts]


def closed_loop(url: str, texts: Sequence[str], concurrency: int) -> dict[str, Any]:
    """One closed loop over `texts` to `url`'s `/translate`: its figures."""
    result = asyncio.run(load.closed_loop(f"{url}/translate", bodies(texts), concurrency, outputs=False))
    return {**result.stats().to_dict(), "error_samples": result.error_samples}


def translations(url: str, texts: Sequence[str]) -> list[str]:
    """Each text's translation, one request at a time."""
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        return [client.post("/translate", json=body).json()["translatedText"] for body in bodies(texts)]


def better(a: dict[str, Any], b: dict[str, Any], concurrency: int) -> bool:
    """Whether run `a` beats run `b`: at one client the lower p50, else more sentences/s."""
    if concurrency == 1:
        return bool(a["latency_p50_s"] < b["latency_p50_s"])
    return bool(a["sentences_per_s"] > b["sentences_per_s"])


def race(python: str, models_dir: Path, texts: list[str], concurrencies: Sequence[int],
         repeats: int, compare: int, out_dir: Path) -> dict[str, Any]:
    """The grid and the turns at every concurrency, and the translations compared."""
    work = Path(tempfile.mkdtemp(prefix="libretranslate-"))
    packages = argos_package(models_dir / MODEL, work / "packages")
    results: dict[str, Any] = {"grid": [], "turns": [], "sentences": len(texts), "repeats": repeats}
    try:
        for concurrency in concurrencies:
            sample = texts if concurrency > 1 else texts[: max(len(texts) // 5, 1)]
            best: dict[str, Any] | None = None
            for inter, intra, threads in GRID:
                with libretranslate(python, packages, work / "home", out_dir / "libretranslate.log",
                                    inter, intra, threads) as server:
                    closed_loop(server.url, sample[: 2 * concurrency], concurrency)  # warm-up
                    run = {"concurrency": concurrency, "inter_threads": inter, "intra_threads": intra,
                           "threads": threads, **closed_loop(server.url, sample, concurrency)}
                results["grid"].append(run)
                logger.info("LibreTranslate c%d %d x %d, %d threads: %.1f sentences/s, p50 %.1f ms",
                            concurrency, inter, intra, threads, run["sentences_per_s"],
                            1000 * run["latency_p50_s"])
                if best is None or better(run, best, concurrency):
                    best = run
            assert best is not None
            point = (best["inter_threads"], best["intra_threads"], best["threads"])
            with libretranslate(python, packages, work / "home", out_dir / "libretranslate.log",
                                *point) as theirs, \
                    service_process(models_dir, out_dir / "server.log") as ours:
                for server in (theirs, ours):
                    closed_loop(server.url, sample[: 2 * concurrency], concurrency)
                if concurrency == concurrencies[0]:
                    compared = texts[:compare]
                    pairs = zip(translations(theirs.url, compared), translations(ours.url, compared),
                                strict=True)
                    same = [(a == b, a[:1].lower() + a[1:] == b[:1].lower() + b[1:]) for a, b in pairs]
                    results["identical"] = {"sentences": len(same), "exact": sum(s[0] for s in same),
                                            "first_letter_blind": sum(s[1] for s in same)}
                for turn in range(repeats):
                    order = [("LibreTranslate", theirs), ("attnserve", ours)]
                    for side, server in order if turn % 2 == 0 else order[::-1]:
                        run = {"concurrency": concurrency, "turn": turn, "side": side,
                               "setting": list(point) if side == "LibreTranslate" else "defaults",
                               **closed_loop(server.url, sample, concurrency)}
                        results["turns"].append(run)
                        logger.info("turn %d c%d %s: %.1f sentences/s, p50 %.1f ms", turn, concurrency,
                                    side, run["sentences_per_s"], 1000 * run["latency_p50_s"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def markdown(results: dict[str, Any]) -> str:
    """The grid, the turns' medians and their ratios."""
    lines = ["# LibreTranslate's server against attnserve: the same model, the same API", "",
             "## LibreTranslate's grid (one run each)", "",
             "| clients | inter x intra threads | waitress threads | sentences/s | p50 ms | errors |",
             "|---|---|---|---|---|---|"]
    for run in results["grid"]:
        lines.append(f"| {run['concurrency']} | {run['inter_threads']} x {run['intra_threads']} | "
                     f"{run['threads']} | {run['sentences_per_s']:.1f} | {1000 * run['latency_p50_s']:.2f} | "
                     f"{run['errors']} |")
    lines += ["", f"## Alternating turns ({results['repeats']}; medians, ranges)", "",
              "| clients | side | setting | sentences/s | p50 ms | p95 ms | errors |", "|---|---|---|---|---|---|---|"]
    ratios = []
    for concurrency in sorted({run["concurrency"] for run in results["turns"]}):
        medians = {}
        for side in ("LibreTranslate", "attnserve"):
            runs = [r for r in results["turns"] if r["concurrency"] == concurrency and r["side"] == side]
            rates = [r["sentences_per_s"] for r in runs]
            p50 = statistics.median(r["latency_p50_s"] for r in runs)
            medians[side] = (statistics.median(rates), p50)
            setting = runs[0]["setting"]
            lines.append(f"| {concurrency} | {side} | {setting} | {statistics.median(rates):.1f} "
                         f"({min(rates):.1f}-{max(rates):.1f}) | {1000 * p50:.2f} | "
                         f"{1000 * statistics.median(r['latency_p95_s'] for r in runs):.2f} | "
                         f"{sum(r['errors'] for r in runs)} |")
        ratios.append(f"- {concurrency} clients: attnserve / LibreTranslate sentences/s "
                      f"**{medians['attnserve'][0] / medians['LibreTranslate'][0]:.2f}**, p50 "
                      f"**{medians['attnserve'][1] / medians['LibreTranslate'][1]:.2f}**")
    identical = results.get("identical")
    lines += ["", *ratios]
    if identical:
        lines.append(f"- identical translations, one at a time: {identical['exact']} of "
                     f"{identical['sentences']} ({identical['first_letter_blind']} ignoring the case of "
                     "the first letter)")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.libretranslate_race", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libretranslate-python", required=True,
                        help="the python of a virtual environment with libretranslate installed")
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--sentences", type=int, default=1000, help="test sentences per run (a fifth at one client)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=3, help="alternating turns")
    parser.add_argument("--compare", type=int, default=200, help="sentences whose translations are compared")
    parser.add_argument("--out", type=Path, default=Path("bench/results/libretranslate"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    texts = (args.data_dir / MODEL / "test.src").read_text(encoding="utf-8").splitlines()[: args.sentences]
    args.out.mkdir(parents=True, exist_ok=True)
    results = race(args.libretranslate_python, args.models, texts, args.concurrency, args.repeats,
                   args.compare, args.out)
    (args.out / "libretranslate.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "libretranslate.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
