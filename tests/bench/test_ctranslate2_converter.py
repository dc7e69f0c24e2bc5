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
