"""The step graph (each row over its own cache length, written in place) against PyTorch."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.parity import LOGITS_ATOL
from export.step_graph import StepGraph, example_step_inputs, export_step_graph
from model.decoding import greedy_decode, pad_batch
from model.transformer import DecoderCache, LayerCache, Transformer
from service.runtime.step_buffers import CacheBuffers, run_step

SOURCES = [[5, 9, 12, 7, 3], [7, 3], [4, 8, 15, 16, 11, 6, 10, 3]]


@pytest.fixture(scope="module")
def tiny_step(trained_tiny) -> tuple[Transformer, ort.InferenceSession]:
    model = trained_tiny.load().eval()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(export_step_graph(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return model, session


def test_the_pytorch_operator_matches_attention_over_each_rows_past(random_tiny: Transformer) -> None:
    """The custom operator's reference: row b sees columns 0..lengths[b] and nothing after."""
    inputs = example_step_inputs(random_tiny)
    ids, positions, source_mask, past, cross = inputs
    logits, *present = StepGraph(random_tiny)(*inputs)
    for row, length in enumerate(positions[:, 0].tolist()):
        # the same row alone, its past cut to its own length, through the merged decoder's path
        layers = [LayerCache(past[2 * i][row:row + 1, :, :length], past[2 * i + 1][row:row + 1, :, :length],
                             cross[2 * i][row:row + 1], cross[2 * i + 1][row:row + 1])
                  for i in range(random_tiny.config.n_decoder_layers)]
        alone = random_tiny.decode(ids[row:row + 1], DecoderCache(layers, source_mask[row:row + 1]),
                                   positions=positions[row:row + 1])
        torch.testing.assert_close(logits[row], alone.logits[0, 0], atol=1e-5, rtol=1e-5)
        grown = alone.cache.layers[0].self_key[0, :, length]  # (h, d): the new position
        torch.testing.assert_close(present[0][row, :, length], grown)


def test_rows_joining_at_different_steps_decode_what_they_decode_alone(tiny_step) -> None:
    """Rows start at steps 0, 2 and 5 in one batch (a later row's slot holds stale columns from
    before it joined); each decodes the tokens of PyTorch's greedy decoding of it alone."""
    model, session = tiny_step
    config = model.config
    sources = pad_batch(SOURCES, config.pad_id)
    with torch.no_grad():
        expected = [g.tokens for g in greedy_decode(model, sources, max_new_tokens=12)]
        start = model.start_decoding(model.encode(sources, need_weights=False))
    cross = [t.numpy() for layer in start.layers for t in (layer.cross_key, layer.cross_value)]
    source_mask = start.source_mask.numpy()
    joins = [0, 2, 5]
    rows = len(SOURCES)
    buffers = CacheBuffers(config.n_decoder_layers, rows, config.n_heads, 20, config.head_dim)
    positions = np.zeros(rows, dtype=np.int64)
    last = np.full(rows, config.bos_id, dtype=np.int64)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for step in range(joins[-1] + 13):
        for row, join in enumerate(joins):
            if step == join:  # the row (re)starts: position 0, BOS; its old columns stay in the buffer
                positions[row], last[row], tokens[row] = 0, config.bos_id, []
        logits = run_step(session, last[:, None], positions[:, None], source_mask, cross, buffers)
        best = logits.argmax(axis=-1)
        for row in range(rows):
            if step >= joins[row] and not done[row]:
                if best[row] == config.eos_id or len(tokens[row]) == 12:
                    done[row] = True
                else:
                    tokens[row].append(int(best[row]))
        positions = np.minimum(positions + 1, buffers.capacity - 1)
        last = best.astype(np.int64)
    assert tokens == expected


def test_the_step_writes_into_the_bound_buffers(tiny_step) -> None:
    """Past and present share memory: the numpy buffers see each row's new column, and the
    logits match PyTorch's for rows of different lengths."""
    model, session = tiny_step
    config = model.config
    sources = pad_batch(SOURCES, config.pad_id)
    with torch.no_grad():
        start = model.start_decoding(model.encode(sources, need_weights=False))
    cross = [t.numpy() for layer in start.layers for t in (layer.cross_key, layer.cross_value)]
    buffers = CacheBuffers(config.n_decoder_layers, len(SOURCES), config.n_heads, 8, config.head_dim)
    rng = np.random.default_rng(0)
    lengths = np.array([0, 3, 6])
    for array in buffers.arrays:
        array[...] = rng.standard_normal(array.shape)
    before = [array.copy() for array in buffers.arrays]
    ids = np.array([[config.bos_id], [7], [9]])
    logits = run_step(session, ids, lengths[:, None], start.source_mask.numpy(), cross, buffers)
    for row, length in enumerate(lengths):
        layers = [LayerCache(*(torch.from_numpy(before[2 * i + k][row:row + 1, :, :length]) for k in (0, 1)),
                             start.layers[i].cross_key[row:row + 1], start.layers[i].cross_value[row:row + 1])
                  for i in range(config.n_decoder_layers)]
        with torch.no_grad():
            alone = model.decode(torch.from_numpy(ids[row:row + 1]), DecoderCache(layers, start.source_mask[row:row + 1]),
                                 positions=torch.tensor([[length]]))
        np.testing.assert_allclose(logits[row], alone.logits[0, 0].numpy(), atol=LOGITS_ATOL)
        for i in range(config.n_decoder_layers):
            new_key = alone.cache.layers[i].self_key[0, :, length].numpy()  # (h, d)
            np.testing.assert_allclose(buffers.arrays[2 * i][row, :, length], new_key, atol=1e-4)
            # every other column of the row is untouched
            untouched = np.delete(buffers.arrays[2 * i][row], length, axis=1)
            np.testing.assert_array_equal(untouched, np.delete(before[2 * i][row], length, axis=1))


def test_cross_attention_reads_each_rows_own_source_in_place(tiny_step) -> None:
    """Cross-attention is onnxruntime's GroupQueryAttention over each row's own source length
    (as self-attention is over its own cache): two per layer, and the cross keys/values come
    back as outputs bound to their input buffers, unchanged; a row's logits do not depend on
    what its padding columns hold."""
    model, session = tiny_step
    config = model.config
    kinds = [node.op_type for node in export_step_graph(model).graph.node]
    assert kinds.count("GroupQueryAttention") == 2 * config.n_decoder_layers
    sources = pad_batch(SOURCES, config.pad_id)
    with torch.no_grad():
        start = model.start_decoding(model.encode(sources, need_weights=False))
    cross = [t.numpy().copy() for layer in start.layers for t in (layer.cross_key, layer.cross_value)]
    mask = start.source_mask.numpy()
    ids, positions = np.array([[config.bos_id]] * len(SOURCES)), np.zeros((len(SOURCES), 1), dtype=np.int64)
    buffers = CacheBuffers(config.n_decoder_layers, len(SOURCES), config.n_heads, 4, config.head_dim)
    before = [array.copy() for array in cross]
    logits = run_step(session, ids, positions, mask, cross, buffers)
    for array, kept in zip(cross, before, strict=True):
        np.testing.assert_array_equal(array, kept)
    noisy = [array.copy() for array in cross]
    for array in noisy:  # garbage in every padding column
        array[~mask[:, None, :, None].repeat(array.shape[1], 1).repeat(array.shape[3], 3)] = 1e4
    buffers = CacheBuffers(config.n_decoder_layers, len(SOURCES), config.n_heads, 4, config.head_dim)
    np.testing.assert_allclose(run_step(session, ids, positions, mask, noisy, buffers), logits, atol=1e-5)


def test_a_row_without_a_source_reads_its_first_column(tiny_step) -> None:
    """A row whose source mask is all False (never stepped by the service) attends to column 0,
    as a row with a one-column source does, instead of reading an undefined position."""
    model, session = tiny_step
    config = model.config
    sources = pad_batch(SOURCES, config.pad_id)
    with torch.no_grad():
        start = model.start_decoding(model.encode(sources, need_weights=False))
    cross = [t.numpy().copy() for layer in start.layers for t in (layer.cross_key, layer.cross_value)]
    ids, positions = np.array([[config.bos_id]] * len(SOURCES)), np.zeros((len(SOURCES), 1), dtype=np.int64)
    empty, first = start.source_mask.numpy().copy(), start.source_mask.numpy().copy()
    empty[0], first[0] = False, False
    first[0, 0] = True
    logits = {}
    for name, mask in (("empty", empty), ("first", first)):
        buffers = CacheBuffers(config.n_decoder_layers, len(SOURCES), config.n_heads, 4, config.head_dim)
        logits[name] = run_step(session, ids, positions, mask, [a.copy() for a in cross], buffers)
    assert np.isfinite(logits["empty"]).all()
    np.testing.assert_allclose(logits["empty"], logits["first"], atol=1e-5)
