"""The host KV cache grows in place: a decoder step writes its new positions into spare columns."""

from __future__ import annotations

import numpy as np
import pytest

from service.kv_cache import CACHE_ROOM, KVCache, narrow_weights, widen_mask
from service.runtime import ModelRuntime


def _arrays(batch: int, length: int, seed: int, layers: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((batch, 2, length, 4), dtype=np.float32) for _ in range(layers)]


def test_extend_writes_into_the_same_buffers_and_keeps_the_shorter_cache_valid() -> None:
    keys, values = _arrays(3, 5, 0), _arrays(3, 5, 1)
    cache = KVCache.on_host(keys, values, room=2)
    assert cache.length == 5 and cache.buffers is not None and cache.buffers.capacity == 7
    new_keys, new_values = _arrays(3, 1, 2), _arrays(3, 1, 3)
    grown = cache.extend(new_keys, new_values)
    assert grown.buffers is cache.buffers  # no copy
    assert grown.length == 6 and cache.length == 5
    for i in range(2):
        np.testing.assert_array_equal(grown.keys[i], np.concatenate([keys[i], new_keys[i]], axis=2))
        np.testing.assert_array_equal(grown.values[i], np.concatenate([values[i], new_values[i]], axis=2))
        np.testing.assert_array_equal(cache.keys[i], keys[i])
    fed_keys, _ = grown.feeds()
    assert fed_keys[0] is cache.buffers.keys[0] and fed_keys[0].shape[2] == 7  # the whole buffer


def test_a_second_continuation_copies_instead_of_overwriting_the_first() -> None:
    cache = KVCache.on_host(_arrays(2, 3, 0), _arrays(2, 3, 1))
    first = cache.extend(_arrays(2, 1, 2), _arrays(2, 1, 3))
    second = cache.extend(_arrays(2, 1, 4), _arrays(2, 1, 5))
    assert second.buffers is not first.buffers
    np.testing.assert_array_equal(first.keys[0][:, :, 3:], _arrays(2, 1, 2)[0])
    np.testing.assert_array_equal(second.keys[0][:, :, 3:], _arrays(2, 1, 4)[0])


def test_full_buffers_are_copied_once_with_new_room() -> None:
    cache = KVCache.on_host(_arrays(2, 3, 0), _arrays(2, 3, 1), room=1)
    one = cache.extend(_arrays(2, 1, 2), _arrays(2, 1, 3))
    two = one.extend(_arrays(2, 2, 4), _arrays(2, 2, 5))  # 2 positions, no room left: copied
    assert one.buffers is cache.buffers and two.buffers is not one.buffers
    assert two.length == 6 and two.buffers is not None and two.buffers.capacity == 6 + CACHE_ROOM
    np.testing.assert_array_equal(two.keys[1][:, :, :4], one.keys[1])
    three = two.extend(_arrays(2, 1, 6), _arrays(2, 1, 7))
    assert three.buffers is two.buffers


def test_select_keeps_the_spare_columns() -> None:
    cache = KVCache.on_host(_arrays(3, 4, 0), _arrays(3, 4, 1), room=3)
    rows = np.array([2, 2, 0])
    picked = cache.select(rows)
    assert picked.buffers is not None and picked.buffers.capacity == 7 and picked.length == 4
    np.testing.assert_array_equal(picked.values[1], cache.values[1][rows])
    assert picked.extend(_arrays(3, 1, 2), _arrays(3, 1, 3)).buffers is picked.buffers


def test_widen_mask_and_narrow_weights() -> None:
    mask = np.array([[False, True, True, True], [True, True, False, True]])  # P = 3, T = 1
    wide = widen_mask(mask, past=3, capacity=5)
    assert wide.tolist() == [[False, True, True, False, False, True], [True, True, False, False, False, True]]
    weights = np.arange(2 * 6, dtype=np.float32).reshape(2, 1, 1, 6)
    assert narrow_weights(weights, past=3, capacity=5).reshape(2, 4).tolist() == [[0, 1, 2, 5], [6, 7, 8, 11]]
    assert widen_mask(mask, 3, 3) is mask


def test_decoding_over_spare_columns_gives_the_same_numbers(tiny_runtime: ModelRuntime) -> None:
    """Spare (masked) columns, zeros or stale values, change nothing: logits, attention, cache."""
    runtime = tiny_runtime
    state = runtime.encode(runtime.pad([[5, 9, 12, 3], [7, 3]]))
    first = runtime.decode(np.array([[2, 9], [2, 4]]), state)
    compact = KVCache([np.ascontiguousarray(k) for k in first.cache.keys],
                      [np.ascontiguousarray(v) for v in first.cache.values])
    roomy = KVCache.on_host(list(compact.keys), list(compact.values), room=5)
    assert roomy.buffers is not None
    for buffer in roomy.buffers.keys + roomy.buffers.values:
        buffer[:, :, 2:] = 1e3  # stale values in the spare columns
    token = np.array([[6], [8]])
    expected = runtime.decode(token, state, compact, need_attention=True)
    actual = runtime.decode(token, state, roomy, need_attention=True)
    assert actual.cache.buffers is roomy.buffers
    np.testing.assert_allclose(actual.logits, expected.logits, atol=1e-5)
    for a, e in zip(actual.self_attentions, expected.self_attentions, strict=True):  # type: ignore[arg-type]
        assert a.shape == e.shape == (2, runtime.n_heads, 1, 3)
        np.testing.assert_allclose(a, e, atol=1e-6)
    for a, e in zip(actual.cache.keys + actual.cache.values, expected.cache.keys + expected.cache.values, strict=True):
        np.testing.assert_allclose(a, e, atol=1e-6)


@pytest.mark.parametrize("room", [0, 1])
def test_a_cache_without_room_is_copied_with_room(tiny_runtime: ModelRuntime, room: int) -> None:
    runtime = tiny_runtime
    state = runtime.encode(runtime.pad([[5, 3]]))
    cache = runtime.decode(np.array([[2]]), state).cache
    cache = KVCache.on_host([np.ascontiguousarray(k) for k in cache.keys],
                            [np.ascontiguousarray(v) for v in cache.values], room=room)
    grown = runtime.decode(np.array([[5], ]), state, cache).cache
    assert (grown.buffers is cache.buffers) == (room == 1)
