"""Row copies in the host slot buffers (`copy_rows`): straight row by row when no row is both
read and written, staged when one is; either way the result of reading every source first."""

from __future__ import annotations

import numpy as np
import pytest

from service.runtime.step_buffers import HostSlots, copy_rows


def _expected(array: np.ndarray, sources: list[int], targets: list[int], columns: int | None) -> np.ndarray:
    out = array.copy()
    read = [array[s].copy() for s in sources]  # every source before any write
    for target, row in zip(targets, read, strict=True):
        if columns is None:
            out[target] = row
        else:
            out[target, :, :columns] = row[:, :columns]
    return out


@pytest.mark.parametrize(("sources", "targets"), [
    ([6, 7, 5], [0, 3, 1]),  # rows leaving: the last rows into the holes (disjoint)
    ([1, 0, 0], [0, 1, 2]),  # beams changing parents: a swap and a copy (overlapping)
    ([2, 3], [3, 4]),  # a chain: row 3 is read and written
])
@pytest.mark.parametrize("columns", [None, 3])
def test_copy_rows_reads_every_source_before_writing(sources: list[int], targets: list[int],
                                                     columns: int | None) -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((8, 2, 5, 4)).astype(np.float32) for _ in range(3)]
    expected = [_expected(a, sources, targets, columns) for a in arrays]
    copy_rows(arrays, np.asarray(sources), np.asarray(targets), columns)
    for got, want in zip(arrays, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_host_slots_move_cache_columns_and_cross_rows() -> None:
    rng = np.random.default_rng(1)
    slots = HostSlots(2, 6, 2, 5, 4, width=3)
    for array in (*slots.buffers.arrays, *slots.cross):
        array[:] = rng.standard_normal(array.shape)
    cache = [_expected(a, [4, 5], [0, 2], 2) for a in slots.buffers.arrays]
    cross = [_expected(a, [4, 5], [0, 2], None) for a in slots.cross]
    slots.move_rows(np.array([4, 5]), np.array([0, 2]), 2)
    for got, want in zip((*slots.buffers.arrays, *slots.cross), (*cache, *cross), strict=True):
        np.testing.assert_array_equal(got, want)
    before = [a.copy() for a in slots.cross]
    slots.move_rows(np.array([1]), np.array([3]), 5, cross=False)  # a beam's cache only
    assert all((a == b).all() for a, b in zip(slots.cross, before, strict=True))
