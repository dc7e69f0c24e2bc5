"""`bench.draft_tokens`: speculative greedy decoding with free drafts gives greedy's tokens in
fewer decoder calls when the drafts are right, and the same calls as one token per call when
there are none."""

from __future__ import annotations

import json
from pathlib import Path

from bench import draft_tokens
from bench.draft_tokens import NgramTable, source_draft, speculative
from service.generation.search import generate
from service.runtime import ModelRuntime

TEXTS = ("abc de", "fg hij", "klm nop qr")


def test_the_table_chains_the_most_frequent_next_piece() -> None:
    table = NgramTable.build([[2, 5, 6, 7, 3], [2, 5, 6, 7, 3], [2, 5, 6, 8, 3], [2, 9, 6, 8, 3]])
    assert table.draft([2, 5], 4, eos_id=3) == [6, 7, 3]  # (5, 6) -> 7 twice, 8 once; then EOS ends it
    assert table.draft([2, 9], 4, eos_id=3, min_count=1) == [6, 8, 3]
    assert table.draft([2, 9], 4, eos_id=3) == []  # (2, 9) and 9 each seen once
    assert table.draft([4, 5], 4, eos_id=3) == [6, 7, 3]  # (4, 5) unseen: the single piece 5's next
    assert table.draft([2, 5], 1, eos_id=3) == [6]
    assert table.draft([4], 4, eos_id=3) == []  # an unseen piece drafts nothing


def test_source_drafts_follow_the_last_occurrence_of_the_last_piece() -> None:
    assert source_draft([2, 7], [5, 7, 8, 9, 7, 10, 3], 2) == [10, 3]
    assert source_draft([2, 4], [5, 7, 3], 2) == []


def test_right_drafts_give_greedy_tokens_in_fewer_calls(tiny_runtime: ModelRuntime) -> None:
    sources = [tiny_runtime.tokenizer.encode(text) + [tiny_runtime.eos_id] for text in TEXTS]
    reference = [generate(tiny_runtime, [s], 1, 32)[0].tokens for s in sources]
    # the tiny model reverses its input: a table of its own outputs drafts them
    table = NgramTable.build([tiny_runtime.decoder_start_id, *tokens, tiny_runtime.eos_id] for tokens in reference)
    for source, tokens in zip(sources, reference, strict=True):
        drafted, calls = speculative(tiny_runtime, source, 4, "ngram", table, 32, min_count=1)
        assert drafted == tokens and calls < len(tokens) + 1
        alone, calls = speculative(tiny_runtime, source, 4, "ngram", NgramTable({}, {}), 32)
        assert alone == tokens and calls == len(tokens) + 1  # no drafts: one token per call, EOS included
        assert speculative(tiny_runtime, source, 4, "source", None, 32)[0] == tokens
    limited, _ = speculative(tiny_runtime, sources[2], 4, "ngram", table, 3, min_count=1)
    assert limited == reference[2][:3]


def test_the_command_writes_its_report(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    models, data = tiny_bench_dirs
    table_text = tmp_path / "targets.txt"
    table_text.write_text("ed cba\njih gf\n", encoding="utf-8")
    out = tmp_path / "draft.json"
    assert draft_tokens.main(["--model", str(models / "tiny-reverse"), "--data-dir", str(data), "--sentences", "4",
                              "--drafts", "2", "--table-text", str(table_text), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python -m bench.draft_tokens --model ")
    assert [(row["drafter"], row["k"]) for row in report["speculative"]] == [("ngram", 2), ("source", 2)]
    assert all(row["same_tokens"] == 1.0 and row["tokens_per_call"] >= 1.0 for row in report["speculative"])
    assert report["merged_decoder_one_token_per_call"]["calls_per_sentence"] > 1
    assert out.with_suffix(".md").read_text().startswith("# Drafted tokens for a lone sentence (4 sentences")
