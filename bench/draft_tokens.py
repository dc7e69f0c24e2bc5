"""Speculative greedy decoding of a lone sentence with cheap drafts: what it would buy.

    python -m bench.draft_tokens --model models/translate-en-it --data-dir data \\
        --table-text data/translate-en-it/train.tgt --out bench/results/draft-tokens/draft_tokens.json

A lone sentence's decoder step reads every weight for one row, so a call on k + 1 positions of
one row costs little more than a call on one: verifying k drafted tokens at once pays if enough
of them are right. The drafts here cost nothing to make: the target side's most frequent next
piece after the last two (else the last one) in `--table-text` (an n-gram table, chained k
times; a context seen fewer than `--min-count` times drafts nothing), or the source's pieces
after the last occurrence of the last generated piece (prompt lookup: the vocabulary is shared,
so names and numbers copy through). Each call feeds the row's last token and its drafts to the
merged decoder (`runtime.decode` on (1, 1 + k) positions after the cache); the draft is
accepted up to its first piece that is not the step's argmax, that argmax is the next token,
and the cache keeps the positions of the accepted pieces.

Against two baselines on the same sentences, one intra-op thread: the merged decoder one token
per call (whose tokens the drafts must reproduce) and the step graph's lone row
(`generate_running` with one slot, as the server decodes a lone request). With int8 graphs a
call on several positions quantizes their activations together, so its tokens may differ from
one position at a time: the share of sentences with the baseline's exact tokens is reported.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine
from bench.workload import SPLITS
from service.batching.slot_batch import generate_running
from service.generation.search import generate
from service.runtime import KVCache
from service.runtime.protocol import Runtime

DRAFTERS = ("ngram", "source")


@dataclass(frozen=True)
class NgramTable:
    """The most frequent next piece after each pair of pieces (`pairs`) and after each piece
    (`singles`), with its count."""

    pairs: dict[tuple[int, int], tuple[int, int]]
    singles: dict[int, tuple[int, int]]

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]]) -> NgramTable:
        """From target-side sequences, each already starting with the decoder's start id and
        ending with EOS."""
        pairs: defaultdict[tuple[int, int], Counter[int]] = defaultdict(Counter)
        singles: defaultdict[int, Counter[int]] = defaultdict(Counter)
        for ids in sequences:
            for i in range(1, len(ids)):
                singles[ids[i - 1]][ids[i]] += 1
                if i >= 2:
                    pairs[(ids[i - 2], ids[i - 1])][ids[i]] += 1
        return cls({k: c.most_common(1)[0] for k, c in pairs.items()},
                   {k: c.most_common(1)[0] for k, c in singles.items()})

    def draft(self, history: Sequence[int], k: int, eos_id: int, min_count: int = 2) -> list[int]:
        """Up to `k` pieces after `history` (the start id and the tokens so far), chained."""
        out: list[int] = []
        context = list(history[-2:])
        while len(out) < k:
            found = self.pairs.get((context[-2], context[-1])) if len(context) >= 2 else None
            if found is None or found[1] < min_count:
                found = self.singles.get(context[-1])
            if found is None or found[1] < min_count:
                break
            out.append(found[0])
            if found[0] == eos_id:
                break
            context = [context[-1], found[0]]
        return out


def source_draft(history: Sequence[int], source: Sequence[int], k: int) -> list[int]:
    """Up to `k` source pieces after the last place the last piece of `history` occurs in the
    source (none when it does not occur)."""
    last = history[-1]
    for i in range(len(source) - 2, -1, -1):
        if source[i] == last:
            return list(source[i + 1:i + 1 + k])
    return []


def speculative(runtime: Runtime, source: list[int], k: int, drafter: str, table: NgramTable | None,
                max_new_tokens: int, min_count: int = 2) -> tuple[list[int], int]:
    """Greedy tokens of one source (ids ending with EOS) with drafts of up to `k` pieces verified
    per merged-decoder call; returns (tokens without EOS, calls)."""
    state = runtime.encode(runtime.pad([source]))
    history = [runtime.decoder_start_id]
    tokens: list[int] = []
    cache: KVCache | None = None
    last = runtime.decoder_start_id
    calls = 0
    while len(tokens) < max_new_tokens:
        room = max_new_tokens - len(tokens) - 1
        if drafter == "ngram":
            assert table is not None
            drafts = table.draft(history, min(k, room), runtime.eos_id, min_count)
        else:
            drafts = source_draft(history, source, min(k, room))
        out = runtime.decode(np.asarray([[last, *drafts]], dtype=np.int64), state, cache)
        calls += 1
        best = out.logits[0].argmax(-1)  # (1 + len(drafts),)
        accepted = 0
        while accepted < len(drafts) and int(best[accepted]) == drafts[accepted]:
            accepted += 1
        kept = (cache.length if cache is not None else 0) + 1 + accepted  # last token and accepted drafts
        cache = KVCache([key[:, :, :kept] for key in out.cache.keys],  # type: ignore[index]
                        [value[:, :, :kept] for value in out.cache.values], out.cache.gather)  # type: ignore[index]
        for token in (int(t) for t in best[:accepted + 1]):
            if token == runtime.eos_id:
                return tokens, calls
            tokens.append(token)
            history.append(token)
            if len(tokens) == max_new_tokens:
                break
        last = tokens[-1]
    return tokens, calls


def measure(runtime: Runtime, sources: list[list[int]], drafts: Sequence[int], drafters: Sequence[str],
            table: NgramTable | None, max_new_tokens: int) -> dict[str, Any]:
    """The baselines and each (drafter, k): ms per sentence, calls, tokens per call, exact share."""
    started = time.perf_counter()
    reference = [generate(runtime, [s], 1, max_new_tokens, greedy_scores=False)[0].tokens for s in sources]
    merged_s = time.perf_counter() - started
    started = time.perf_counter()
    for index, source in enumerate(sources):
        list(generate_running(runtime, [(index, source)], rows=1, max_new_tokens=max_new_tokens))
    slot_s = time.perf_counter() - started
    tokens = sum(len(t) for t in reference)
    count = len(sources)
    result: dict[str, Any] = {
        "sentences": count, "tokens": tokens,
        "merged_decoder_one_token_per_call": {"ms_per_sentence": round(1000 * merged_s / count, 3),
                                              "calls_per_sentence": round((tokens + count) / count, 2)},
        "step_graph_lone_row": {"ms_per_sentence": round(1000 * slot_s / count, 3)},
        "speculative": [],
    }
    for drafter in drafters:
        for k in drafts:
            started = time.perf_counter()
            runs = [speculative(runtime, s, k, drafter, table, max_new_tokens) for s in sources]
            seconds = time.perf_counter() - started
            calls = sum(c for _, c in runs)
            made = sum(len(t) for t, _ in runs)
            result["speculative"].append({
                "drafter": drafter, "k": k, "ms_per_sentence": round(1000 * seconds / count, 3),
                "calls_per_sentence": round(calls / count, 2),
                "tokens_per_call": round((made + count) / calls, 3),  # each sentence's EOS included
                "same_tokens": round(sum(t == r for (t, _), r in zip(runs, reference, strict=True)) / count, 4),
            })
    return result


def markdown(result: dict[str, Any]) -> str:
    one = result["merged_decoder_one_token_per_call"]
    lines = [f"# Drafted tokens for a lone sentence ({result['sentences']} sentences, {result['variant']}, one thread)",
             "", f"`{result['command']}`", "",
             "| decoding | ms per sentence | calls per sentence | tokens per call | same tokens as one per call |",
             "|---|---|---|---|---|",
             f"| merged decoder, one token per call | {one['ms_per_sentence']} | {one['calls_per_sentence']} | 1 | 1.0 |",
             f"| step graph, a lone row (the server's path) | {result['step_graph_lone_row']['ms_per_sentence']} | "
             + f"{one['calls_per_sentence']} | 1 | - |"]
    for row in result["speculative"]:
        lines.append(f"| {row['drafter']} drafts, k = {row['k']} | {row['ms_per_sentence']} | "
                     f"{row['calls_per_sentence']} | {row['tokens_per_call']} | {row['same_tokens']} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.draft_tokens`: speculative greedy decoding of lone sentences with free drafts."""
    parser = argparse.ArgumentParser(prog="python -m bench.draft_tokens", description=main.__doc__)
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--split", choices=SPLITS, default="test")
    parser.add_argument("--sentences", type=int, default=300)
    parser.add_argument("--table-text", type=Path,
                        help="target-side text, one sentence per line, for the n-gram drafts "
                             "(e.g. data/<model>/train.tgt); without it only source drafts run")
    parser.add_argument("--min-count", type=int, default=2)
    parser.add_argument("--drafts", type=int, nargs="+", default=[2, 4, 8], help="k: pieces drafted per call")
    parser.add_argument("--variant", help="the repository's variant (default: the one served)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from bench import workload as workload_module
    from bench.in_process import load_runtime
    from model.tokenizer import Tokenizer
    from service.repository.manifest import read_manifest

    runtime = load_runtime(args.model, threads=args.threads, variant=args.variant)
    tokenizer = Tokenizer.from_file(args.model / "tokenizer.model")
    work = workload_module.load(args.data_dir, args.model.name, read_manifest(args.model).task, tokenizer, runtime.max_source_len,
                                args.sentences, args.split)
    table = None
    drafters = ["source"]
    if args.table_text is not None:
        lines = workload_module.read_lines(args.table_text, sys.maxsize)
        table = NgramTable.build([runtime.decoder_start_id, *ids, runtime.eos_id]
                                 for ids in tokenizer.encode_target_batch(lines))
        drafters = ["ngram", "source"]
    result = measure(runtime, work.source_ids, args.drafts, drafters, table, runtime.max_target_len)
    result.update(command=shlex.join(["python", "-m", "bench.draft_tokens", *(sys.argv[1:] if argv is None else argv)]),
                  machine=machine.describe(), variant=runtime.variant, split=args.split,
                  table_contexts=len(table.pairs) if table is not None else 0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
