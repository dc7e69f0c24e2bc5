"""The onnxruntime generation loop gives exactly the tokens of the PyTorch reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from model.decoding import beam_search, greedy_decode, pad_batch
from model.transformer import Transformer
from service.generation.hooks import RowHooks
from service.generation.search import (
    GenerationResult,
    generate,
    log_softmax,
    teacher_forced_attention,
    top_k,
)
from service.runtime import ModelRuntime


@pytest.fixture(scope="module")
def sources(trained_tiny) -> list[list[int]]:
    """12 validation sources of 3-8 tokens, EOS-terminated, plus two the model never saw the like
    of (longer than its training sources, so it does not stop cleanly)."""
    return [s + [3] for s in trained_tiny.valid.sources[:12]] + [[4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 3], [19] * 10 + [3]]


def _same(actual: list[GenerationResult], expected) -> None:
    assert [(g.tokens, g.finish_reason) for g in actual] == [(g.tokens, g.finish_reason) for g in expected]
    assert [g.score for g in actual] == pytest.approx([g.score for g in expected], abs=1e-4)


def test_greedy_without_scores_picks_the_same_tokens(tiny_runtime: ModelRuntime, sources) -> None:
    scored = generate(tiny_runtime, sources, 1, 12)
    unscored = generate(tiny_runtime, sources, 1, 12, greedy_scores=False)
    assert [(g.tokens, g.finish_reason) for g in unscored] == [(g.tokens, g.finish_reason) for g in scored]
    assert all(g.score is None for g in unscored) and all(g.score is not None for g in scored)
    beams = generate(tiny_runtime, sources[:2], 3, 12, greedy_scores=False)  # beam search always scores
    assert all(g.score is not None for g in beams)


@pytest.mark.parametrize("rows", [1, 3, 14])
def test_greedy_equals_pytorch(tiny_runtime: ModelRuntime, tiny_repository_model: Transformer, sources, rows: int) -> None:
    batch = sources[-rows:]
    _same(generate(tiny_runtime, batch, 1, 12), greedy_decode(tiny_repository_model, pad_batch(batch, 0), 12))


@pytest.mark.parametrize(("beam_size", "length_penalty"), [(3, 1.0), (3, 0.6), (2, 1.0)])
def test_beam_search_equals_pytorch(tiny_runtime: ModelRuntime, tiny_repository_model: Transformer, sources, beam_size: int,
                                    length_penalty: float) -> None:
    expected = beam_search(tiny_repository_model, pad_batch(sources, 0), beam_size, 12, length_penalty)
    _same(generate(tiny_runtime, sources, beam_size, 12, length_penalty), expected)


def test_token_limit_counts_eos_and_finishes_with_length(tiny_runtime: ModelRuntime, tiny_repository_model: Transformer, sources) -> None:
    for beam_size in (1, 3):
        actual = generate(tiny_runtime, sources[:4], beam_size, 2)
        _same(actual, beam_search(tiny_repository_model, pad_batch(sources[:4], 0), beam_size, 2))
        assert all(len(g.tokens) <= 2 for g in actual)
    assert {g.finish_reason for g in generate(tiny_runtime, sources[:4], 1, 2)} == {"length"}


def test_the_tiny_model_reverses_text(tiny_runtime: ModelRuntime) -> None:
    """What the service tests can count on: pieces come back reversed."""
    tokenizer = tiny_runtime.tokenizer
    sources = [tokenizer.encode(text) + [tiny_runtime.eos_id] for text in ("abc de", "kol")]
    outputs = generate(tiny_runtime, sources, 3, tiny_runtime.max_target_len)
    assert [tokenizer.decode(o.tokens).strip() for o in outputs] == ["ed cba", "lok"]
    assert all(o.finish_reason == "eos" for o in outputs)


def test_teacher_forced_attention(tiny_runtime: ModelRuntime, tiny_repository_model: Transformer) -> None:
    import torch

    source, target = [5, 9, 12, 7, 3], [7, 12, 9, 5]
    maps = teacher_forced_attention(tiny_runtime, source, target)
    assert maps.decoder_ids == [2, *target]
    assert [a.shape for a in maps.encoder] == [(4, 5, 5)] * 2
    assert [a.shape for a in maps.decoder] == [(4, 5, 5)] * 2
    assert [a.shape for a in maps.cross] == [(4, 5, 5)] * 2
    assert np.allclose(np.triu(maps.decoder[0], k=1), 0.0)  # causal
    with torch.no_grad():
        encoded = tiny_repository_model.encode(torch.tensor([source]))
        out = tiny_repository_model.decode(torch.tensor([maps.decoder_ids]), tiny_repository_model.start_decoding(encoded))
    for actual, expected in zip(maps.cross, out.cross_attentions, strict=True):
        np.testing.assert_allclose(actual, expected[0].numpy(), atol=1e-4)


def test_warmup_and_select(tiny_runtime: ModelRuntime) -> None:
    tiny_runtime.warmup()
    state = tiny_runtime.encode(tiny_runtime.pad([[5, 3], [6, 7, 3]]))
    picked = tiny_runtime.select(state, [1, 1, 0])
    assert picked.source_mask.tolist() == [[True, True, True]] * 2 + [[True, True, False]]
    assert np.array_equal(picked.cross_keys[0][2], state.cross_keys[0][0])


def test_top_k_and_log_softmax() -> None:
    scores = np.array([[0.1, 3.0, -1.0, 2.0, 3.0]], dtype=np.float32)
    values, index = top_k(scores, 3)
    assert index.tolist() == [[1, 4, 3]] and values.tolist() == [[3.0, 3.0, 2.0]]
    assert np.exp(log_softmax(scores)).sum() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("size", [63, 1024, 4 * 8000, 4 * 8000 + 37])
def test_top_k_is_a_stable_sort_of_the_row(size: int) -> None:
    """Short rows and long ones (where only the elements above a bound from the groups' maxima
    are sorted) give the k best of a full stable sort: scores, indices and the order of ties,
    with rows of many equal scores, rows whose first half is -inf (dead beams) and rows whose
    best elements all fall in one group (every `blocks`-th element)."""
    rng = np.random.default_rng(size)
    for trial in range(40):
        scores = rng.standard_normal((3, size)).astype(np.float32)
        if trial % 2:
            scores = np.round(scores * 4) / 4  # many ties
        if trial % 5 == 0:
            scores[1, : size // 2] = -np.inf
        if trial % 7 == 0:  # the best elements all in one group: indices 3, 3 + G, 3 + 2G, ...
            scores[2, 3::max(1, size // 64)] += 10
        k = int(rng.integers(1, 9))
        expected = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
        values, index = top_k(scores, k)
        np.testing.assert_array_equal(index, expected)
        np.testing.assert_array_equal(values, np.take_along_axis(scores, expected, axis=-1))


def test_bad_arguments(tiny_runtime: ModelRuntime) -> None:
    assert generate(tiny_runtime, [], 1, 4) == []
    with pytest.raises(ValueError, match="EOS"):
        generate(tiny_runtime, [[]], 1, 4)
    with pytest.raises(ValueError, match=">= 1"):
        generate(tiny_runtime, [[5, 3]], 0, 4)


def test_runtime_and_generation_import_no_torch() -> None:
    code = "import sys, service.generation.search, service.runtime; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, cwd=Path(__file__).parents[3]).returncode == 0


class _Hooks(RowHooks):
    """Records the tokens streamed to it; reads as cancelled from its `cancel_at`-th check (one
    check per decoder step of its row)."""

    def __init__(self, cancel_at: int | None = None) -> None:
        self.tokens: list[int] = []
        super().__init__(on_token=self.tokens.append)
        self.cancel_at = cancel_at
        self.checks = 0

    @property
    def cancelled(self) -> bool:
        self.checks += 1
        return self.cancel_at is not None and self.checks >= self.cancel_at


class _CountingRuntime:
    """The runtime, recording the decoder batch (rows) of every step."""

    def __init__(self, runtime: ModelRuntime) -> None:
        self.runtime = runtime
        self.rows: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.runtime, name)

    def decode(self, input_ids, *args, **kwargs):
        self.rows.append(int(input_ids.shape[0]))
        return self.runtime.decode(input_ids, *args, **kwargs)


def test_greedy_streams_each_token_and_changes_nothing(tiny_runtime: ModelRuntime, sources) -> None:
    hooks = [_Hooks() for _ in sources]
    streamed = generate(tiny_runtime, sources, 1, 12, hooks=hooks)
    _same(streamed, generate(tiny_runtime, sources, 1, 12))
    assert [h.tokens for h in hooks] == [g.tokens for g in streamed]
    assert any(h.tokens for h in hooks)


def test_a_cancelled_row_leaves_the_batch(tiny_runtime: ModelRuntime, sources) -> None:
    batch = [s for s in sources[:12] if len(s) >= 7][:2]  # 6+ tokens to reverse, limit 4:
    plain = generate(tiny_runtime, batch, 1, 4)  # no row finishes before the limit
    assert [g.finish_reason for g in plain] == ["length", "length"]
    for beam_size in (1, 2):
        counting = _CountingRuntime(tiny_runtime)
        hooks = [_Hooks(cancel_at=2), None]
        out = generate(counting, batch, beam_size, 4, hooks=hooks)  # type: ignore[arg-type]
        assert out[0].finish_reason == "cancelled" and len(out[0].tokens) == 2
        _same(out[1:], generate(tiny_runtime, batch[1:], beam_size, 4))  # the other row is untouched
        if beam_size == 1:
            assert hooks[0].tokens == plain[0].tokens[:2]
        else:
            assert hooks[0].tokens == []  # beam search streams nothing while it searches
        # Two rows (times the beams) for the first steps, then one row until the limit.
        assert counting.rows == [2 * beam_size] * 2 + [beam_size] * 2


def test_int8_sessions_fold_constant_dequantize_without_changing_tokens(tiny_model_repository, sources) -> None:
    """The int8 variant's sessions run without onnxruntime's QDQ passes (constant weights
    dequantized once): the same tokens as sessions that keep them."""
    import dataclasses

    from service.runtime import model_runtime as runtime_module

    folded = ModelRuntime.load(tiny_model_repository, providers=["CPUExecutionProvider"], variant="int8")
    encoder, decoder, _ = runtime_module._sessions(tiny_model_repository, folded.manifest.variants["int8"],
                                                   "CPUExecutionProvider", 0, fold_dequantize=False)
    plain = dataclasses.replace(folded, encoder=encoder, decoder=decoder)
    assert [r.tokens for r in generate(folded, sources, 1, 12)] == [r.tokens for r in generate(plain, sources, 1, 12)]


def test_greedy_choice_equals_argmax_of_log_softmax() -> None:
    from service.generation.search import greedy_choice, log_softmax

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 50)) * 30).astype(np.float32)
    logits[1] = 0.0  # a tie everywhere: the first index, like argmax
    logits[2, 7] = 1e4  # one certain token
    best, chosen = greedy_choice(logits)
    log_probs = log_softmax(logits)
    np.testing.assert_array_equal(best, log_probs.argmax(axis=-1))
    np.testing.assert_allclose(chosen, log_probs[np.arange(6), best], atol=1e-5)
    assert best[1] == 0 and chosen[1] == pytest.approx(-np.log(50)) and chosen[2] == 0.0
