"""The k best entries of each row of a score matrix, without sorting the row: beam search's
candidates (`service.generation.search`) and sampling's top k and nucleus
(`service.generation.sampling`)."""

from __future__ import annotations

import numpy as np

TOP_K_BLOCK = 64  # `top_k`: at most this many elements per group whose maxima bound a long row's k-th best


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (score, index) of each row of (R, N) `scores`, best first; equal scores in
    index order.

    A long row is not partitioned whole: the k-th largest of its groups' maxima is a value that
    at least k elements reach, so the k best are among the elements at or above it, and only
    those are sorted: a pass of `max` over a row costs far less than a partition of it (a
    beam-search step asks this of k x vocabulary candidates per row; sampling, of a row's
    vocabulary). The row's first G x m elements form G >= 4k groups of m elements (at most
    `TOP_K_BLOCK`), element i in group i mod G, so the maxima are an elementwise `max` of m
    contiguous slices rather than a reduction per block."""
    k = min(k, scores.shape[-1])
    rows, size = scores.shape
    per_group = min(TOP_K_BLOCK, size // (4 * k))
    if per_group < 2:  # a short row: sorted whole
        index = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
        return np.take_along_axis(scores, index, axis=-1), index
    blocks = size // per_group
    maxima = scores[:, :blocks * per_group].reshape(rows, per_group, blocks).max(axis=1)  # (R, blocks)
    floors = np.partition(maxima, blocks - k, axis=-1)[:, blocks - k]  # (R,): k elements reach it
    index = np.empty((rows, k), dtype=np.int64)
    for row in range(rows):
        candidates = np.flatnonzero(scores[row] >= floors[row])  # ascending: ties stay in index order
        index[row] = candidates[np.argsort(-scores[row, candidates], kind="stable")[:k]]
    return np.take_along_axis(scores, index, axis=-1), index
