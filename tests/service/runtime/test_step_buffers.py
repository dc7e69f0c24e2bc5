"""Row copies in the host slot buffers (`copy_rows`): straight row by row when no row is both
read and written, staged when one is; either way the result of reading every source first."""

from __future__ import annotations

import numpy as np
import pytest

from service.runtime.step_buffers import (
    HostSlots,
    binding_kept,
    copy_rows,
    last_source_arrays,
    last_source_columns,
)


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


def test_int8_cross_keys_values_are_quantized_to_their_scales_as_they_are_written() -> None:
    with pytest.raises(ValueError, match="scales"):
        HostSlots(1, 2, 1, 4, 2, width=3, cache_dtype=np.int8, cross_dtype=np.int8)
    slots = HostSlots(1, 2, 1, 4, 2, width=3, cache_dtype=np.int8, cross_dtype=np.int8, cross_scales=[0.5, 0.01])
    key = np.array([[[[1.2, -0.3], [100.0, 0.26]]]], dtype=np.float32)  # (1 row, 1 head, 2 columns, 2)
    value = np.full((1, 1, 2, 2), -0.035, dtype=np.float32)
    slots.write(1, [key, value])
    assert slots.cross[0].dtype == np.int8
    assert slots.cross[0][1, 0, :2].tolist() == [[2, -1], [127, 1]]  # nearest multiples of 0.5, clipped at 127
    assert slots.cross[1][1, 0, :2].tolist() == [[-4, -4], [-4, -4]]
    assert slots.cross[0][1, 0, 2].tolist() == [0, 0] and not slots.cross[0][0].any()  # padding and other slots
    grown = slots.resized(4, 8, 3, 2, 1)
    assert grown.cross_scales == [0.5, 0.01] and grown.cross[0][1, 0, :2].tolist() == [[2, -1], [127, 1]]


def test_last_source_columns_are_each_rows_last_source_key_value_dequantized() -> None:
    rng = np.random.default_rng(2)
    cross = [rng.integers(-127, 128, (3, 2, 5, 4)).astype(np.int8) for _ in range(2)]  # (rows, h, S, d)
    mask = np.zeros((3, 5), dtype=bool)
    mask[0, :5], mask[1, :2] = True, True  # row 2: an empty source reads column 0, as the graph clamps it
    arrays = last_source_arrays(4, cross)
    assert list(arrays) == ["source_last", "cross_last_key.0", "cross_last_value.0"]
    source_last, last = arrays["source_last"], [arrays["cross_last_key.0"], arrays["cross_last_value.0"]]
    source_last[:] = -1
    assert all(a.shape == (4, 1, 8) and a.dtype == np.float32 for a in last)
    last_source_columns(cross, mask, [0.5, 0.25], arrays)
    assert source_last.tolist() == [4, 1, 0, -1]  # the fourth row is not among the rows given
    for array, out, scale in zip(cross, last, (0.5, 0.25), strict=True):
        for row, column in enumerate((4, 1, 0)):
            np.testing.assert_array_equal(out[row, 0], array[row, :, column].reshape(-1).astype(np.float32) * np.float32(scale))
        assert not out[3].any()
    floats = [a.astype(np.float32) for a in cross]
    last_source_columns(floats, mask, None, arrays)
    np.testing.assert_array_equal(last[1][1, 0], floats[1][1, :, 1].reshape(-1))
    for array in arrays.values():  # from a start row on: the rows before it are left as they are
        array[:] = -1
    last_source_columns(cross, mask, [0.5, 0.25], arrays, start=1)
    assert source_last.tolist() == [-1, 1, 0, -1]
    assert (last[0][0] == -1).all() and (last[1][0] == -1).all()
    np.testing.assert_array_equal(last[1][1, 0], cross[1][1, :, 1].reshape(-1).astype(np.float32) * np.float32(0.25))


class _Step:
    """What `binding_kept` reads of a step session: its providers, inputs' and outputs' names and
    types (weak-referenceable, as sessions are)."""

    def __init__(self, provider: str, cache: str, cross: str, cross_in_place: bool) -> None:
        from types import SimpleNamespace

        self.providers = [provider, "CPUExecutionProvider"]
        self.inputs = [SimpleNamespace(name="past_key.0", type=cache), SimpleNamespace(name="cross_key.0", type=cross)]
        self.outputs = [SimpleNamespace(name="logits", type="tensor(float)")]
        if cross_in_place:
            self.outputs.append(SimpleNamespace(name="present_cross_key.0", type=cross))

    def get_providers(self) -> list[str]:
        return self.providers

    def get_inputs(self) -> list:
        return self.inputs

    def get_outputs(self) -> list:
        return self.outputs


F32, F16 = "tensor(float)", "tensor(float16)"


@pytest.mark.parametrize(("provider", "cache", "cross", "in_place", "kept_on"), [
    ("CPUExecutionProvider", F32, F32, True, "cpu"),
    ("CPUExecutionProvider", F16, F16, False, "cpu"),
    ("CUDAExecutionProvider", F16, F16, True, "cuda"),  # the attention's CUDA kernel reads both
    ("CUDAExecutionProvider", F16, F32, False, "cuda"),  # cross keys/values read by CUDA's own nodes
    ("CUDAExecutionProvider", F32, F32, True, "cpu"),  # no float32 CUDA kernel: the CPU attention reads both
    ("CUDAExecutionProvider", F32, F32, False, None),  # the cache read on the CPU, the cross keys on CUDA
    ("CUDAExecutionProvider", F16, F32, True, None),  # the cache on CUDA, the cross keys/values on the CPU
])
def test_a_binding_is_kept_only_where_every_reader_of_the_slots_runs(provider: str, cache: str, cross: str,
                                                                      in_place: bool, kept_on: str | None) -> None:
    """onnxruntime copies a bound input to its reader's device when it is bound: a binding is kept
    over steps only for slots on the device where the attention (and whatever reads the cross
    keys/values) runs."""
    step = _Step(provider, cache, cross, in_place)
    assert [device for device in ("cpu", "cuda") if binding_kept(step, device)] == ([kept_on] if kept_on else [])
