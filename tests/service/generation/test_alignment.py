"""Word alignments from hand-made cross-attention: words, rows, aggregation, extraction, scores."""

from __future__ import annotations

import numpy as np
import pytest

from service.generation.alignment import (
    BASELINE,
    DEFAULT,
    Method,
    Word,
    align,
    extract,
    parse_pharaoh,
    pharaoh,
    piece_rows,
    score,
    word_matrix,
    word_of_pieces,
    words,
)


def test_words_are_whitespace_separated_with_their_spans() -> None:
    text = " Hello,  world!\tok"
    assert words(text) == [Word("Hello,", 1, 7), Word("world!", 9, 15), Word("ok", 16, 18)]
    assert words("   ") == []


def test_pieces_belong_to_the_word_they_overlap() -> None:
    # "▁un" "believ" "able" "▁" "!" "</s>": the spans of sentencepiece include the leading space.
    text = "unbelievable !"
    spans = [(0, 2), (2, 8), (8, 12), (12, 13), (13, 14), (14, 14)]
    assert word_of_pieces(spans, words(text)) == [0, 0, 0, None, 1, None]
    # A piece with its leading space belongs to the word after the space.
    assert word_of_pieces([(0, 2), (2, 5)], words("ab cd")) == [0, 1]


def test_rows_average_the_chosen_layers_and_heads_and_shift_by_one() -> None:
    cross = np.zeros((2, 2, 3, 2))  # (layers, heads, rows, source)
    cross[0, 0] = [[1, 0], [0, 1], [1, 0]]
    cross[0, 1] = [[0, 1], [0, 1], [1, 0]]
    cross[1, :] = [[0.5, 0.5], [1, 0], [0, 1]]
    np.testing.assert_allclose(piece_rows(cross, 2, Method(layers=(0,))), [[0.5, 0.5], [0, 1]])
    np.testing.assert_allclose(piece_rows(cross, 2, Method(layers=(0,), heads=(1,))),
                               [[0, 1], [0, 1]])
    np.testing.assert_allclose(piece_rows(cross, 2, Method(layers=(-1,), shift=True)),
                               [[1, 0], [0, 1]])  # rows 1 and 2: those reading pieces 0 and 1
    np.testing.assert_allclose(piece_rows(cross, 2, Method()),
                               [[0.5, 0.5], [0.5, 0.5]])  # all layers, all heads
    with pytest.raises(ValueError, match="3 rows for 3 target pieces .shifted"):
        piece_rows(cross, 3, Method(shift=True))
    with pytest.raises(ValueError, match="must be .layers, heads, rows, source."):
        piece_rows(cross[0], 2, Method())


def test_word_matrix_means_target_pieces_and_sums_source_pieces() -> None:
    # Target pieces: word 0, word 0, none; source positions: word 0, word 1, word 1, </s>.
    rows = np.array([[0.2, 0.3, 0.1, 0.4],
                     [0.0, 0.5, 0.5, 0.0],
                     [1.0, 0.0, 0.0, 0.0]])
    matrix = word_matrix(rows, [0, 0, None], [0, 1, 1], n_target_words=2, n_source_words=2)
    np.testing.assert_allclose(matrix, [[0.1, 0.7], [0.0, 0.0]])
    with pytest.raises(ValueError, match="for 2 target and 3 source pieces"):
        word_matrix(rows, [0, 0], [0, 1, 1], 1, 2)


MATRIX = np.array([  # (target words, source words)
    [0.7, 0.2, 0.1],
    [0.6, 0.3, 0.1],
    [0.1, 0.1, 0.8],
    [0.1, 0.5, 0.4],
])


@pytest.mark.parametrize("extraction, threshold, expected", [
    ("t2s", 0.0, {(0, 0), (0, 1), (2, 2), (1, 3)}),
    ("s2t", 0.0, {(0, 0), (1, 3), (2, 2)}),
    ("intersect", 0.0, {(0, 0), (1, 3), (2, 2)}),
    ("union", 0.0, {(0, 0), (0, 1), (2, 2), (1, 3)}),
    ("threshold", 0.45, {(0, 0), (0, 1), (2, 2), (1, 3)}),
    ("threshold", 0.65, {(0, 0), (2, 2)}),
])
def test_extractions(extraction: str, threshold: float, expected: set[tuple[int, int]]) -> None:
    method = Method(extraction=extraction, threshold=threshold)  # type: ignore[arg-type]
    assert extract(MATRIX, method) == expected


def test_grow_diag_adds_union_links_beside_the_intersection_for_uncovered_words() -> None:
    # t2s: 0->0, 1->0, 2->2; s2t: 0->0, 1->1, 2->2. Intersection {(0,0), (2,2)}; grow-diag adds
    # (0,1) beside (0,0) (target word 1 uncovered) and (1,1) diagonal to it (source word 1).
    matrix = np.array([[0.9, 0.05, 0.05], [0.5, 0.4, 0.1], [0.0, 0.2, 0.8]])
    assert extract(matrix, Method(extraction="intersect")) == {(0, 0), (2, 2)}
    assert extract(matrix, Method(extraction="union")) == {(0, 0), (0, 1), (1, 1), (2, 2)}
    assert extract(matrix, Method(extraction="grow-diag")) == {(0, 0), (0, 1), (1, 1), (2, 2)}
    # Target word 4 leans to source word 0 (t2s: (0, 4)), source word 4 to it (s2t: (4, 4)):
    # (4, 4) lies beside (3, 3) and is added; (0, 4) lies beside no link and is not.
    far = np.eye(5)
    far[4] = [0.6, 0.0, 0.0, 0.0, 0.4]
    assert extract(far, Method(extraction="intersect")) == {(0, 0), (1, 1), (2, 2), (3, 3)}
    assert (0, 4) in extract(far, Method(extraction="union"))
    assert extract(far, Method(extraction="grow-diag")) == {(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)}
    assert extract(np.zeros((0, 3)), Method()) == set()


def test_align_recovers_a_reordering_across_multi_piece_words() -> None:
    """Source "big red car" (4 pieces: "▁big" "▁red" "▁ca" "r"), target "macchina rossa grande"
    (4 pieces: "▁macchina" "▁ros" "sa" "▁grande"); the last two layers attend to the source
    piece each target piece translates, the first layer does not."""
    source, target = "big red car", "macchina rossa grande"
    source_spans = [(0, 3), (3, 7), (7, 10), (10, 11)]
    target_spans = [(0, 8), (8, 12), (12, 14), (14, 21)]
    attended = [2, 1, 1, 0, 4]  # source position of each row (the last predicts </s>: reads it)
    cross = np.full((3, 2, 5, 5), 0.02)  # (layers, heads, rows, source + </s>)
    for row, position in enumerate(attended):
        cross[1:, :, row, position] += 0.9
        cross[0, :, row, 4] += 0.9  # the first layer looks at </s>
    cross /= cross.sum(axis=-1, keepdims=True)
    found = align(cross, source, source_spans, target, target_spans, DEFAULT)
    assert found.links == [(0, 2), (1, 1), (2, 0)]
    assert found.pharaoh == "0-2 1-1 2-0"
    assert [w.text for w in found.source_words] == ["big", "red", "car"]
    assert found.target_words[1] == Word("rossa", 9, 14)
    # Shifted rows read the next piece's source: every link moves.
    shifted = align(cross, source, source_spans, target, target_spans,
                    Method(layers=(-1,), shift=True, extraction="t2s"))
    assert shifted.links != found.links
    # The first layer gives every source piece the same weight (the rest is </s>'s, left out):
    # "car", of two pieces, is every target word's heaviest source word.
    assert {i for i, _ in align(cross, source, source_spans, target, target_spans,
                                Method(layers=(0,), extraction="t2s")).links} == {2}


def test_unaligned_words_stay_unaligned_with_a_threshold() -> None:
    """A target word attending to </s> gets no link by threshold, one by argmax."""
    cross = np.array([[[[0.9, 0.1], [0.05, 0.95]]]])  # one layer and head; rows "gatto", "."
    source, target = "cat", "gatto ."
    found = align(cross, source, [(0, 3)], target, [(0, 5), (5, 7)],
                  Method(extraction="threshold", threshold=0.5))
    assert found.links == [(0, 0)]
    assert align(cross, source, [(0, 3)], target, [(0, 5), (5, 7)], BASELINE).links == [(0, 0), (0, 1)]


def test_scores() -> None:
    predicted = [{(0, 0), (1, 1), (2, 1)}, {(0, 0)}]
    sure = [{(0, 0), (1, 1), (2, 2)}, {(0, 1)}]
    s = score(predicted, sure)
    assert (s.predicted, s.gold, s.correct) == (4, 4, 2)
    assert (s.precision, s.recall, s.f1) == (0.5, 0.5, 0.5)
    assert s.aer == pytest.approx(1 - s.f1)
    with_possible = score(predicted, sure, possible=[{(2, 1)}, set()])
    assert with_possible.precision == 0.75 and with_possible.recall == 0.5
    assert with_possible.aer == pytest.approx(1 - (2 + 3) / (4 + 4))
    empty = score([set()], [set()])
    assert (empty.precision, empty.recall, empty.f1, empty.aer) == (0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="one set of links per sentence"):
        score([set()], [])


def test_pharaoh_round_trip_and_errors() -> None:
    assert parse_pharaoh("0-0 2-1 1?3") == {(0, 0), (2, 1), (1, 3)}
    assert pharaoh([(0, 0), (2, 1)]) == "0-0 2-1"
    assert parse_pharaoh("") == set()
    for bad in ("0-", "a-1", "01"):
        with pytest.raises(ValueError, match="not a Pharaoh link"):
            parse_pharaoh(bad)


def test_methods_are_checked_and_named() -> None:
    with pytest.raises(ValueError, match="unknown extraction 'max'"):
        Method(extraction="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a threshold in .0, 1. is needed"):
        Method(extraction="threshold")
    with pytest.raises(ValueError, match="`layers` is empty"):
        Method(layers=())
    assert Method(layers=(1, 2), heads=(0,), shift=True, extraction="threshold", threshold=0.3).name \
        == "L1+2/h0/shift/threshold0.3"
    assert BASELINE.name == "L-1/h*/predict/t2s"
