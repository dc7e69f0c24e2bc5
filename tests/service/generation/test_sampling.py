"""Sampling (`service.generation.sampling`): the pieces kept against a full sort of the
distribution, the draws' frequencies against the tempered softmax, seeded draws repeatable per
row, settings out of range refused; and `top_k`, which finds the nucleus, against a stable sort."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from service.generation.ranking import top_k
from service.generation.sampling import Sampling, draw, kept


def _nucleus_by_full_sort(logits: np.ndarray, settings: Sampling) -> list[int]:
    """The pieces to keep, the slow way: every probability sorted, then cut."""
    probs = np.exp(logits.astype(np.float64) / settings.temperature)
    probs /= probs.sum()
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    if settings.top_k is not None:
        order = order[:settings.top_k]
    mass = probs[order] / probs[order].sum()
    keep, total = [], 0.0
    for i, p in zip(order, mass, strict=True):
        keep.append(i)
        total += p
        if total >= settings.top_p - 1e-12:
            break
    return keep


@pytest.mark.parametrize("settings", [
    Sampling(1.0, top_k=1), Sampling(0.7, top_k=5), Sampling(1.0, top_p=0.5), Sampling(0.5, top_p=0.9),
    Sampling(2.0, top_p=0.99), Sampling(1.0, top_k=300, top_p=0.8), Sampling(1.0, top_k=40, top_p=0.95),
])
@pytest.mark.parametrize("spread", [0.5, 3.0, 8.0])
def test_the_pieces_kept_are_the_top_k_and_the_nucleus(settings: Sampling, spread: float) -> None:
    logits = (np.random.default_rng(7).standard_normal(8000) * spread).astype(np.float32)
    ids, probs = kept(logits, settings)
    assert ids.tolist() == _nucleus_by_full_sort(logits, settings)
    assert probs.sum() == pytest.approx(1.0) and (np.diff(probs) <= 1e-15).all()


def test_without_top_k_or_top_p_every_piece_is_kept() -> None:
    logits = np.random.default_rng(1).standard_normal(50).astype(np.float32)
    ids, probs = kept(logits, Sampling(0.8))
    expected = np.exp(logits / 0.8) / np.exp(logits / 0.8).sum()
    assert ids.tolist() == list(range(50)) and np.allclose(probs, expected)


def test_equal_logits_keep_the_lower_ids_first() -> None:
    logits = np.zeros(200, dtype=np.float32)
    logits[[5, 90, 150]] = 2.0
    assert kept(logits, Sampling(1.0, top_k=2))[0].tolist() == [5, 90]
    assert kept(logits, Sampling(1.0, top_k=5))[0].tolist() == [5, 90, 150, 0, 1]


def test_draws_follow_the_tempered_distribution() -> None:
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
    draws = 40_000
    for settings in (Sampling(0.5, seed=3), Sampling(1.5, seed=4), Sampling(1.0, top_k=3, seed=5)):
        sampler = settings.sampler(0)
        counts = np.bincount([sampler.sample(logits) for _ in range(draws)], minlength=6)
        ids, probs = kept(logits, settings)
        expected = np.zeros(6)
        expected[ids] = probs
        sigma = np.sqrt(expected * (1 - expected) / draws)
        assert (np.abs(counts / draws - expected) <= 5 * sigma + 1e-12).all(), (settings, counts)
        assert counts[expected == 0].sum() == 0


@pytest.mark.parametrize("settings", [Sampling(1.0, seed=6), Sampling(0.8, top_p=0.7, seed=7)])
def test_draws_over_a_long_row_follow_its_distribution(settings: Sampling) -> None:
    """A row longer than a few blocks is drawn block first, then within the block."""
    logits = np.full(1000, -4.0, dtype=np.float32)
    logits[[3, 64, 127, 128, 640, 999]] = [1.0, 0.5, 0.2, 0.0, 0.7, 0.9]  # at the ends of blocks of 64
    draws = 30_000
    samplers = [settings.sampler(i) for i in range(draws)]  # one draw per row: all drawn at once
    counts = np.bincount(draw(np.tile(logits, (draws, 1)), samplers), minlength=1000)
    ids, probs = kept(logits, settings)
    expected = np.zeros(1000)
    expected[ids] = probs
    sigma = np.sqrt(expected * (1 - expected) / draws)
    assert (np.abs(counts / draws - expected) <= 5 * sigma + 1e-12).all()
    assert counts[expected == 0].sum() == 0 and counts[[3, 999]].min() > 0


@pytest.mark.parametrize("settings", [Sampling(1.0, top_p=0.95), Sampling(1.0, top_k=20), Sampling(0.7)])
def test_a_row_draws_the_same_beside_other_rows_as_alone(settings: Sampling) -> None:
    """Rows of other seeds and of nuclei of other widths drawn together change no row's draw."""
    rng = np.random.default_rng(3)
    peaked = (rng.standard_normal(8000) * 2).astype(np.float32)
    peaked[[10, 20]] += 30  # a nucleus of two pieces
    flat = (rng.standard_normal(8000) * 0.1).astype(np.float32)  # a nucleus of thousands
    logits = np.stack([peaked, flat, peaked[::-1].copy()])
    for seed in range(100):
        together = draw(logits, [dataclasses.replace(settings, seed=seed + row).sampler(row) for row in range(3)])
        alone = [draw(logits[row:row + 1], [dataclasses.replace(settings, seed=seed + row).sampler(row)])[0]
                 for row in range(3)]
        assert together.tolist() == alone


def test_a_seed_repeats_a_rows_draws_and_rows_draw_apart() -> None:
    logits = np.zeros(1000, dtype=np.float32)
    settings = Sampling(1.0, seed=11)
    first = settings.sampler(0).sample(logits)
    runs = [[s.sample(logits) for _ in range(20)] for s in (settings.sampler(0), settings.sampler(0),
                                                             settings.sampler(1), Sampling(1.0, seed=12).sampler(0))]
    assert runs[0] == runs[1] and first == runs[0][0]
    assert runs[0] != runs[2] and runs[0] != runs[3]
    unseeded = Sampling(1.0)
    assert [unseeded.sampler(0).sample(logits) for _ in range(20)] != [unseeded.sampler(0).sample(logits)
                                                                       for _ in range(20)]


@pytest.mark.parametrize("settings", [
    {"temperature": 0}, {"temperature": -1}, {"temperature": float("nan")}, {"temperature": 1, "top_k": 0},
    {"temperature": 1, "top_p": 0}, {"temperature": 1, "top_p": 1.01}, {"temperature": 1, "seed": -1},
])
def test_settings_out_of_range_are_refused(settings: dict) -> None:
    with pytest.raises(ValueError):
        Sampling(**settings)


@pytest.mark.parametrize("k", [1, 8, 31, 32, 63, 64, 100, 500, 1999, 2000, 8000])
def test_top_k_equals_a_stable_sort_at_every_group_size(k: int) -> None:
    scores = np.random.default_rng(k).integers(0, 40, (3, 8000)).astype(np.float32)  # many ties
    values, index = top_k(scores, k)
    expected = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    assert (index == expected).all() and (values == np.take_along_axis(scores, expected, axis=-1)).all()
