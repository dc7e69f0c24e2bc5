"""The CTranslate2 converter on the tiny model: same weights, same greedy outputs as ours."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.ctranslate2_converter import convert, sinusoidal_table, vocabulary
from model.embedding import sinusoidal_encoding

ctranslate2 = pytest.importorskip("ctranslate2")


def test_sinusoidal_table_matches_the_model() -> None:
    table = sinusoidal_table(40, 64)  # (40, 64)
    expected = sinusoidal_encoding(torch.arange(40)[None], 64)[0].numpy()  # (40, 64)
    np.testing.assert_allclose(table, expected, atol=1e-5)


def test_vocabulary_is_the_tokenizer_pieces_padded(tiny_model_repository: Path) -> None:
    pieces = vocabulary(tiny_model_repository / "tokenizer.model", 24)
    assert pieces[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert len(pieces) == len(set(pieces)) == 24
    assert pieces[20:] == ["<unused_20>", "<unused_21>", "<unused_22>", "<unused_23>"]


@pytest.fixture(scope="module")
def tiny_ct2(tiny_model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(tiny_model_repository, tmp_path_factory.mktemp("ct2") / "tiny")


@pytest.mark.parametrize("max_batch_size", [1, 4, 64])
def test_ctranslate2_greedy_equals_ours(tiny_ct2: Path, tiny_runtime, tiny_model_repository: Path,
                                        max_batch_size: int) -> None:
    from bench import ctranslate2_runs
    from service.generation.search import generate

    tokenizer = tiny_runtime.tokenizer
    texts = (tiny_model_repository.parent / "data" / "test.src").read_text(encoding="utf-8").split("\n")
    sources = [tokenizer.encode(t) + [tiny_runtime.eos_id] for t in texts if t][:20]
    ours = [tokenizer.pieces(r.tokens) for r in generate(tiny_runtime, sources, 1, tiny_runtime.max_target_len)]
    translator = ctranslate2_runs.load_translator(tiny_ct2, "float32", threads=1)
    theirs = ctranslate2_runs.translate(translator, [tokenizer.pieces(s) for s in sources], 1,
                                        tiny_runtime.max_target_len, max_batch_size)
    assert ctranslate2_runs.agreement(ours, theirs) == 1.0
    assert ours == theirs
    # the tiny model reverses its input: CTranslate2 does too
    assert theirs[0] == tokenizer.pieces(sources[0][:-1])[::-1]


def test_ctranslate2_int8_and_beam_run(tiny_ct2: Path, tiny_runtime) -> None:
    from bench import ctranslate2_runs

    tokenizer = tiny_runtime.tokenizer
    pieces = [tokenizer.pieces(tokenizer.encode(t) + [tiny_runtime.eos_id]) for t in ("abc de", "fgh")]
    translator = ctranslate2_runs.load_translator(tiny_ct2, "int8", threads=1)
    stats, outputs = ctranslate2_runs.run_batch(translator, pieces, 4, tiny_runtime.max_target_len)
    assert stats.sentences == 2 and len(outputs) == 2
    assert stats.target_tokens == sum(len(o) for o in outputs) > 0
    single = ctranslate2_runs.run_single(translator, pieces, 1, tiny_runtime.max_target_len)
    assert single.sentences == 2 and single.latency_p50_s is not None


def test_agreement_counts_exact_matches() -> None:
    from bench.ctranslate2_runs import agreement

    assert agreement([["a", "b"], ["c"]], [["a", "b"], ["d"]]) == 0.5
    with pytest.raises(ValueError):
        agreement([["a"]], [])


def test_thread_grid_covers_the_cores_as_users_tune() -> None:
    from bench.ctranslate2_runs import BATCH_GRID, settings_grid, thread_grid

    assert thread_grid(2) == [(1, 0), (1, 2), (2, 1)]
    assert thread_grid(8) == [(1, 0), (1, 8), (8, 1), (2, 4)]
    assert thread_grid(1) == [(1, 0), (1, 1)]
    grid = settings_grid(2)
    assert len(grid) == 3 * len(BATCH_GRID) and len({s.key for s in grid}) == len(grid)
    assert {s.batch_type for s in grid} == {"examples", "tokens"}


def test_the_grid_runs_every_point_and_keeps_the_best(tiny_ct2: Path, tiny_runtime) -> None:
    from bench import ctranslate2_runs
    from bench.ctranslate2_runs import Ct2Settings

    tokenizer = tiny_runtime.tokenizer
    pieces = [tokenizer.pieces(tokenizer.encode(t) + [tiny_runtime.eos_id]) for t in ("abc de", "fgh", "ijk lm")]
    grid = [Ct2Settings(1, 1, 2), Ct2Settings(1, 1, 64, "tokens"), Ct2Settings(2, 1, 1)]
    result = ctranslate2_runs.run_grid(tiny_ct2, "int8", pieces, tiny_runtime.max_target_len, grid, single=pieces[:2])
    assert [p["settings"] for p in result["points"]] == [s.to_dict() for s in grid]
    assert all(p["sentences"] == 3 and p["target_tokens"] > 0 for p in result["points"])
    assert result["best"]["sentences_per_s"] == max(p["sentences_per_s"] for p in result["points"])
    assert [p["settings"]["inter_threads"] for p in result["single_points"]] == [1, 2]
    assert result["best_single"] in result["single_points"]
