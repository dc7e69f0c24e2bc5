"""Parity of an exported model repository with PyTorch: same numbers, same tokens.

For a batch of one source and a batch of several sources of mixed lengths (right-padded):
1. encoder: every layer's self-attention and the cross-attention keys/values;
2. greedy decoding through onnxruntime (`service.generation.search`, key/value cache, rows leaving
   the batch) gives exactly the tokens and finish reasons of `model.decoding.greedy_decode`;
3. without cache: one decoder call on the start token (BOS unless the model names another) + those tokens (past length 0, right-padded target)
   matches PyTorch's logits, present keys/values and self-/cross-attention;
4. with cache: the same targets fed one token a step, each step on the previous step's
   present keys/values, match step t of PyTorch's teacher-forced call.
5. the step graph (`decoder_step.onnx`, when the variant has one): the same targets one token a
   step, each row in its cache buffer, match PyTorch's logits; greedy decoding in a running
   batch on it (`service.batching.slot_batch.SlotBatch`) gives PyTorch's tokens.
A difference beyond the tolerances raises a `ParityError` naming the output, the case and
the size of the difference.

The step graph of a reduced-precision variant (fp16, int8) computes other numbers: `step_agreement`
compares its greedy tokens in a running batch with the fp32 step graph's, row by row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from model.decoding import greedy_decode
from model.transformer import Transformer
from service.batching.slot_batch import SlotBatch
from service.generation.search import generate
from service.runtime import EncoderState, ModelRuntime, to_numpy
from service.runtime.step_buffers import CacheBuffers, run_step

log = logging.getLogger(__name__)

# Largest absolute difference allowed between onnxruntime (fp32, CPU) and PyTorch (fp32).
# Measured differences are ~1e-6 (tiny test model) to ~1e-5 (the 8000-word models): the
# bounds leave an order of magnitude or more for other CPUs and kernels.
LOGITS_ATOL = 1e-3  # logits are O(10)
ATTENTION_ATOL = 1e-4  # probabilities in [0, 1]
KEY_VALUE_ATOL = 1e-4  # keys/values are O(1)
# A reduced-precision variant's step graph decodes the fp32 step graph's tokens on at least this
# share of rows: its arithmetic may move a close call, and a row differs from that step on; a
# graph converted wrongly differs on (nearly) every row.
MIN_STEP_AGREEMENT = 0.5


class ParityError(AssertionError):
    """onnxruntime and PyTorch disagree."""


class StepDisagreement(ParityError):
    """A variant's step graph decodes other tokens than the fp32 step graph on too many rows."""


class OutputMismatch(ParityError):
    """A graph output differs from PyTorch by more than its tolerance."""

    def __init__(self, output: str, case: str, max_abs_diff: float, tolerance: float, where: tuple[int, ...]) -> None:
        super().__init__(f"{output} ({case}) differs from PyTorch by {max_abs_diff:.3g} > {tolerance:g} "
                         f"at index {where}")
        self.output, self.case, self.max_abs_diff, self.tolerance = output, case, max_abs_diff, tolerance


class TokenMismatch(ParityError):
    """Greedy decoding through onnxruntime chose other tokens (or stopped otherwise) than PyTorch."""

    def __init__(self, case: str, row: int, expected: tuple[list[int], str], actual: tuple[list[int], str]) -> None:
        super().__init__(f"greedy tokens ({case}, row {row}): PyTorch {expected[0]} ({expected[1]}), "
                         f"onnxruntime {actual[0]} ({actual[1]})")
        self.case, self.row, self.expected, self.actual = case, row, expected, actual


@dataclass
class ParityReport:
    """The largest difference seen per kind of output, and what was compared."""

    max_abs_diff: dict[str, float] = field(default_factory=dict)
    cases: list[str] = field(default_factory=list)
    greedy_rows: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "tolerances": {"logits": LOGITS_ATOL, "attention": ATTENTION_ATOL, "key_value": KEY_VALUE_ATOL},
            "max_abs_diff": {k: float(f"{v:.3g}") for k, v in sorted(self.max_abs_diff.items())},
            "cases": self.cases,
            "greedy_rows_identical": self.greedy_rows,
        }


class _Comparer:
    def __init__(self, report: ParityReport, case: str) -> None:
        self.report, self.case = report, case

    def __call__(self, kind: str, output: str, actual: np.ndarray, expected: torch.Tensor, tolerance: float) -> None:
        reference = expected.detach().float().numpy()
        if actual.shape != reference.shape:
            raise OutputMismatch(f"{output} shape {actual.shape} vs {reference.shape}", self.case,
                                 float("inf"), tolerance, ())
        diff = np.abs(actual.astype(np.float32) - reference)
        worst = float(diff.max()) if diff.size else 0.0
        if not np.isfinite(worst) or worst > tolerance:
            where = tuple(int(i) for i in np.unravel_index(int(np.nanargmax(diff)), diff.shape))
            raise OutputMismatch(output, self.case, worst, tolerance, where)
        self.report.max_abs_diff[kind] = max(self.report.max_abs_diff.get(kind, 0.0), worst)


@torch.no_grad()
def check_parity(
    model: Transformer, runtime: ModelRuntime, sources: list[list[int]], max_new_tokens: int = 16
) -> ParityReport:
    """Compare `runtime` with `model` on `sources` (ids ending with EOS, >= 2 of mixed lengths
    for the batched case); raises a `ParityError`, else returns the differences seen."""
    model = model.eval()
    report = ParityReport()
    cases = [("batch 1", sources[:1])]
    if len(sources) > 1:
        cases.append((f"batch {len(sources)}, mixed lengths", sources))
    for case, batch in cases:
        _check_case(model, runtime, batch, max_new_tokens, _Comparer(report, case))
        report.cases.append(case)
        report.greedy_rows += len(batch)
    log.info("parity with PyTorch: %s", report.to_dict()["max_abs_diff"])
    return report


def _check_case(model: Transformer, runtime: ModelRuntime, sources: list[list[int]], max_new_tokens: int,
                compare: _Comparer) -> None:
    config = model.config
    source_np = runtime.pad(sources)
    source = torch.from_numpy(source_np)
    # 1. encoder
    encoded = model.encode(source, need_weights=True)
    start = model.start_decoding(encoded)
    state = runtime.encode(source_np, need_attention=True)
    assert state.attentions is not None
    for i, (actual, expected) in enumerate(zip(state.attentions, encoded.attentions, strict=True)):
        compare("encoder_attention", f"encoder_attention.{i}", actual, expected, ATTENTION_ATOL)
    for i, layer in enumerate(start.layers):
        compare("cross_key_value", f"cross_key.{i}", state.cross_keys[i], layer.cross_key, KEY_VALUE_ATOL)
        compare("cross_key_value", f"cross_value.{i}", state.cross_values[i], layer.cross_value, KEY_VALUE_ATOL)
    # 2. greedy tokens
    expected_gen = greedy_decode(model, source, max_new_tokens)
    actual_gen = generate(runtime, sources, 1, max_new_tokens)
    for row, (e, a) in enumerate(zip(expected_gen, actual_gen, strict=True)):
        if (e.tokens, e.finish_reason) != (a.tokens, a.finish_reason):
            raise TokenMismatch(compare.case, row, (e.tokens, e.finish_reason), (a.tokens, a.finish_reason))
    # 3. without cache: the start token + the generated tokens in one call, right-padded
    targets = [[config.start_id, *g.tokens] for g in expected_gen]
    target_np = runtime.pad(targets)
    target_mask_np = np.zeros(target_np.shape, dtype=bool)
    for row, ids in enumerate(targets):
        target_mask_np[row, : len(ids)] = True
    target, target_mask = torch.from_numpy(target_np), torch.from_numpy(target_mask_np)
    full = model.decode(target, start, target_mask, need_weights=True)
    step = runtime.decode(target_np, state, target_mask=target_mask_np, need_attention=True)
    assert step.self_attentions is not None and step.cross_attentions is not None
    compare("logits", "logits (no cache)", step.logits, full.logits, LOGITS_ATOL)
    for i, layer in enumerate(full.cache.layers):
        compare("present_key_value", f"present_key.{i} (no cache)", step.cache.keys[i], layer.self_key, KEY_VALUE_ATOL)
        compare("present_key_value", f"present_value.{i} (no cache)", step.cache.values[i], layer.self_value,
                KEY_VALUE_ATOL)
        compare("self_attention", f"self_attention.{i} (no cache)", step.self_attentions[i],
                full.self_attentions[i], ATTENTION_ATOL)
        compare("cross_attention", f"cross_attention.{i} (no cache)", step.cross_attentions[i],
                full.cross_attentions[i], ATTENTION_ATOL)
    # 4. with cache: one token a step
    cache = None
    for t in range(target_np.shape[1]):
        step = runtime.decode(target_np[:, t : t + 1], state, cache, target_mask=target_mask_np[:, : t + 1],
                              need_attention=True)
        assert step.self_attentions is not None and step.cross_attentions is not None
        cache = step.cache
        compare("logits", f"logits (cache, step {t})", step.logits[:, 0], full.logits[:, t], LOGITS_ATOL)
        for i in range(config.n_decoder_layers):
            compare("self_attention", f"self_attention.{i} (cache, step {t})", step.self_attentions[i][:, :, 0],
                    full.self_attentions[i][:, :, t, : t + 1], ATTENTION_ATOL)
            compare("cross_attention", f"cross_attention.{i} (cache, step {t})", step.cross_attentions[i][:, :, 0],
                    full.cross_attentions[i][:, :, t], ATTENTION_ATOL)
    assert cache is not None
    for i, layer in enumerate(full.cache.layers):
        compare("present_key_value", f"present_key.{i} (cache)", cache.keys[i], layer.self_key, KEY_VALUE_ATOL)
        compare("present_key_value", f"present_value.{i} (cache)", cache.values[i], layer.self_value, KEY_VALUE_ATOL)
    # 5. the step graph
    if runtime.step is not None:
        _check_step_graph(runtime, state, target_np, target_mask_np, full.logits, expected_gen, sources,
                          max_new_tokens, compare)


def _check_step_graph(runtime: ModelRuntime, state: EncoderState, target_np: np.ndarray, target_mask_np: np.ndarray,
                      full_logits: torch.Tensor, expected_gen: list, sources: list[list[int]],
                      max_new_tokens: int, compare: _Comparer) -> None:
    """Teacher-forced logits one token a step in cache buffers, then greedy tokens in a SlotBatch."""
    assert runtime.step is not None
    batch, length = target_np.shape
    buffers = CacheBuffers(runtime.n_decoder_layers, batch, runtime.n_heads, length, runtime.head_dim)
    cross = [to_numpy(t) for pair in zip(state.cross_keys, state.cross_values, strict=True) for t in pair]
    for t in range(length):
        logits = run_step(runtime.step, target_np[:, t:t + 1], np.full((batch, 1), t, dtype=np.int64),
                          state.source_mask, cross, buffers)  # (B, V)
        rows = target_mask_np[:, t]  # rows whose target is still running at step t
        compare("step_graph_logits", f"step graph logits (step {t})", logits[rows], full_logits[rows, t], LOGITS_ATOL)
    running: SlotBatch[int] = SlotBatch(runtime)
    running.concatenate(sources, list(range(len(sources))), [max_new_tokens] * len(sources))
    results: dict[int, Any] = {}
    while len(running):
        results.update(running.generate_token())
    for row, e in enumerate(expected_gen):
        a = results[row]
        if (e.tokens, e.finish_reason) != (a.tokens, a.finish_reason):
            raise TokenMismatch(f"{compare.case}, step graph", row, (e.tokens, e.finish_reason),
                                (a.tokens, a.finish_reason))


def slot_batch_decode(runtime: ModelRuntime, sources: list[list[int]], max_new_tokens: int,
                      group: int = 32) -> list[tuple[list[int], str]]:
    """Greedy (tokens, finish reason) of each source on the runtime's step graph, in running
    batches (`SlotBatch`, slots where the runtime keeps them) of `group` sources of similar length."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    decoded: dict[int, tuple[list[int], str]] = {}
    for start in range(0, len(order), group):
        rows = order[start:start + group]
        running: SlotBatch[int] = SlotBatch(runtime)
        running.concatenate([sources[i] for i in rows], rows, [max_new_tokens] * len(rows))
        while len(running):
            decoded.update((i, (r.tokens, r.finish_reason)) for i, r in running.generate_token())
    return [decoded[i] for i in range(len(sources))]


def step_agreement(reference: ModelRuntime, runtime: ModelRuntime, sources: list[list[int]],
                   max_new_tokens: int, sources_label: str = "") -> dict[str, Any]:
    """How many `sources` the step graph of `runtime` decodes (greedy, in running batches) to the
    tokens and finish reason of `reference`'s step graph (the fp32 variant's, which `check_parity`
    holds to PyTorch's tokens); raises a `StepDisagreement` below `MIN_STEP_AGREEMENT` of the rows.
    The report names the sources by `sources_label` when given."""
    if reference.step is None or runtime.step is None:
        raise ValueError("both runtimes need a step graph")
    expected = slot_batch_decode(reference, sources, max_new_tokens)
    actual = slot_batch_decode(runtime, sources, max_new_tokens)
    identical = sum(e == a for e, a in zip(expected, actual, strict=True))
    report: dict[str, Any] = {"reference": f"{reference.variant} step graph"}
    if sources_label:
        report["sources"] = sources_label
    report.update(rows=len(sources), rows_identical=identical, max_new_tokens=max_new_tokens,
                  provider=runtime.provider)
    log.info("%s step graph against %s: %s", runtime.variant, reference.variant, report)
    if identical < MIN_STEP_AGREEMENT * len(sources):
        raise StepDisagreement(f"the {runtime.variant} step graph decodes the {reference.variant} step graph's tokens "
                               f"on {identical} of {len(sources)} rows (fewer than {MIN_STEP_AGREEMENT:.0%})")
    return report


def parity_sources(vocab_size: int, eos_id: int, lengths: tuple[int, ...] = (9, 3, 14, 6), seed: int = 0) -> list[list[int]]:
    """Synthetic sources of mixed lengths (ids above the specials, ending with EOS)."""
    rng = np.random.default_rng(seed)
    return [[int(i) for i in rng.integers(4, vocab_size, n - 1)] + [eos_id] for n in lengths]
