"""The vocabulary shortlist's export side (`export.shortlist`): the lexical table from training
pairs, and the step graph whose `vocab` input selects the output projection's columns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from export.shortlist import coverage, shortlist_graphs, table_from_ids
from service.repository.manifest import read_manifest
from service.runtime import CPU, ModelRuntime
from service.runtime.shortlist import Shortlist
from service.runtime.step_buffers import CacheBuffers, run_step
from tests.conftest import TINY_CONFIG, reversal_examples

EOS, UNK = 3, 1
LOGIT_ATOL = 1e-5  # the step graph's logits (|x| ~ 5) and the shortlist graph's, the same float32 weights


def _session(path: str | Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=[CPU])


@pytest.fixture(scope="module")
def int8(tiny_model_repository) -> ModelRuntime:
    return ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="int8")


@pytest.fixture(scope="module")
def shortlist(tiny_shortlist) -> Shortlist:
    return Shortlist.load(*tiny_shortlist, threads=1)


def _steps(runtime: ModelRuntime, session: ort.InferenceSession, sources: list[list[int]],
           tokens: list[np.ndarray], columns: dict[str, np.ndarray] | None) -> list[np.ndarray]:
    """The logits of one step per entry of `tokens` ((B,) inputs), from the decoder start; with
    `columns`, of the shortlist step graph `session` reading them."""
    state = runtime.encode(runtime.pad(sources))
    cross = [np.asarray(t) for pair in zip(state.cross_keys, state.cross_values, strict=True) for t in pair]
    buffers = CacheBuffers(runtime.n_decoder_layers, len(sources), runtime.n_heads, 8, runtime.head_dim)
    out = []
    for position, ids in enumerate(tokens):
        positions = np.full((len(sources), 1), position, dtype=np.int64)
        out.append(run_step(session, ids[:, None], positions, np.asarray(state.source_mask), cross, buffers, columns))
    return out


def _inputs(runtime: ModelRuntime, trained_tiny) -> tuple[list[list[int]], list[np.ndarray]]:
    sources = [s + [EOS] for s in trained_tiny.valid.sources[:6]]
    rng = np.random.default_rng(0)
    tokens = [np.full(len(sources), runtime.decoder_start_id, dtype=np.int64)]
    tokens += [rng.integers(4, TINY_CONFIG.vocab_size, len(sources)) for _ in range(2)]
    return sources, tokens


def test_every_id_in_order_gives_the_step_graphs_logits(int8, shortlist, trained_tiny) -> None:
    sources, tokens = _inputs(int8, trained_tiny)
    assert int8.step is not None
    full = _steps(int8, int8.step, sources, tokens, None)
    everything = np.arange(TINY_CONFIG.vocab_size, dtype=np.int64)
    short = _steps(int8, shortlist.session, sources, tokens, shortlist.columns(everything))
    for a, b in zip(full, short, strict=True):
        assert a.shape == b.shape == (len(sources), TINY_CONFIG.vocab_size)
        # the two projections (all columns, gathered ones) may sum in another float32 order: ~1e-6 apart
        np.testing.assert_allclose(b, a, rtol=0, atol=LOGIT_ATOL)
        assert np.array_equal(b.argmax(axis=-1), a.argmax(axis=-1))


def test_a_shortlist_holding_each_rows_argmax_picks_the_same_tokens(int8, shortlist, trained_tiny) -> None:
    sources, tokens = _inputs(int8, trained_tiny)
    assert int8.step is not None
    full = _steps(int8, int8.step, sources, tokens, None)
    rng = np.random.default_rng(1)
    for step, logits in enumerate(full):
        best = logits.argmax(axis=-1)
        others = rng.choice(TINY_CONFIG.vocab_size, 3, replace=False)
        vocab = np.unique(np.concatenate([best, others]))
        assert len(vocab) < TINY_CONFIG.vocab_size
        columns = shortlist.columns(vocab)
        assert {name: array.shape[-1] for name, array in columns.items()} == dict.fromkeys(columns, len(vocab))
        short = _steps(int8, shortlist.session, sources, tokens[:step + 1], columns)[-1]
        assert short.shape == (len(sources), len(vocab))
        np.testing.assert_allclose(short, logits[:, vocab], rtol=0, atol=LOGIT_ATOL)  # the same columns, computed alone
        assert np.array_equal(vocab[short.argmax(axis=-1)], best)


def test_the_surgery_leaves_the_step_graph_unchanged(tiny_model_repository) -> None:
    step = read_manifest(tiny_model_repository).variants["int8"].step_decoder
    assert step
    model = onnx.load(str(tiny_model_repository / step))
    before = model.SerializeToString()
    rewritten, projection = shortlist_graphs(model)
    assert model.SerializeToString() == before
    # the int8 weight, its per-channel zero points and scales: gathered by the projection graph,
    # read by the step graph, whose projection no longer reads a constant of the vocabulary
    made = [o.name for o in projection.graph.output]
    assert len(made) == 3 and [i.name for i in projection.graph.input] == ["vocab"]
    assert set(made) <= {i.name for i in rewritten.graph.input}
    assert "vocab" not in {name for n in rewritten.graph.node for name in n.input}


def test_the_table_ranks_each_piece_first_for_a_reversal_and_covers_its_references() -> None:
    pairs = reversal_examples(500, seed=0)
    table = table_from_ids(pairs.sources, pairs.targets, TINY_CONFIG.vocab_size, k=1, frequent=0, specials=[EOS, UNK])
    seen = sorted({piece for source in pairs.sources for piece in source})
    assert table.candidates.shape == (TINY_CONFIG.vocab_size, 1)
    assert table.candidates[seen, 0].tolist() == seen  # a piece's reversal holds it in every pair
    assert table.always.tolist() == [UNK, EOS]
    valid = reversal_examples(50, seed=1)
    measured = coverage(table, valid.sources, valid.targets)
    assert measured["token_coverage"] == measured["sentence_coverage"] == 1.0


def test_the_most_frequent_target_pieces_are_always_in() -> None:
    sources = [[4, 5], [4, 6], [5, 6]]
    targets = [[7, 7, 8], [7, 9], [9, 10]]
    table = table_from_ids(sources, targets, 12, k=1, frequent=2, specials=[EOS])
    assert table.always.tolist() == [EOS, 7, 9]  # 7 three times, 9 twice
    assert table.shortlist([[6]]).tolist() == [EOS, 7, 9]  # 6's best partner: 9 (dice 1.0 over two pairs)


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_add_shortlist_ships_the_table_and_graph_and_changes_no_other_file(tiny_model_repository, tiny_data_dir,
                                                                           tmp_path, capsys) -> None:
    import json
    import shutil

    from attnserve.cli import main
    from service.repository.manifest import verify_files

    copy = tmp_path / "tiny"
    shutil.copytree(tiny_model_repository, copy)
    before = _contents(copy)
    assert main(["add-shortlist", "--model-dir", str(copy), "--data-dir", str(tiny_data_dir), "-k", "3", "-n", "0",
                 "--threads", "1", "--max-drop", "100"]) == 0
    entry = json.loads(capsys.readouterr().out)
    manifest = read_manifest(copy)
    verify_files(copy, manifest)
    assert manifest.variants["int8"].shortlist == entry
    assert entry["step_decoder"] == "int8/decoder_step_shortlist.onnx" and entry["table"] == "shortlist.npz"
    assert entry["projection"] == "int8/shortlist_projection.onnx"
    assert entry["k"] == 3 and entry["n"] == 0 and entry["train_pairs"] == 400
    quality = entry["quality"]
    assert quality["rows"] == 40 and set(quality["full"]) == set(quality["shortlist"]) == {"bleu", "chrf"}
    after = _contents(copy)
    new = {"shortlist.npz", "int8/decoder_step_shortlist.onnx", "int8/shortlist_projection.onnx"}
    assert set(after) == set(before) | new
    for name, data in before.items():
        if name == "int8/weights.bin":  # the projection by vocabulary row appended, the rest kept
            assert after[name][:len(data)] == data and len(after[name]) > len(data)
        elif name != "manifest.json":
            assert after[name] == data, name
    # the graphs open with plain onnxruntime; the runtime loads them only when asked
    made = [o.name for o in _session(copy / entry["projection"]).get_outputs()]
    assert set(made) <= {i.name for i in _session(copy / entry["step_decoder"]).get_inputs()}
    assert ModelRuntime.load(copy, [CPU], threads=1, variant="int8").shortlist is None
    runtime = ModelRuntime.load(copy, [CPU], threads=1, variant="int8", shortlist=True)
    assert runtime.shortlist is not None and runtime.shortlist.table.vocab_size == TINY_CONFIG.vocab_size
    # a variant that has one is refused, the repository unchanged
    assert main(["add-shortlist", "--model-dir", str(copy), "--data-dir", str(tiny_data_dir)]) == 2
    assert _contents(copy) == after


def test_a_shortlist_over_the_quality_bound_leaves_the_repository_as_it_was(tiny_model_repository, tiny_data_dir,
                                                                            tmp_path) -> None:
    import shutil

    from export.shortlist import ShortlistTooCostly, add_shortlist

    copy = tmp_path / "tiny"
    shutil.copytree(tiny_model_repository, copy)
    before = _contents(copy)
    with pytest.raises(ShortlistTooCostly):  # a bound that asks a gain of a point: none meets it
        add_shortlist(copy, tiny_data_dir, k=1, frequent=0, max_drop=-1.0, threads=1)
    assert _contents(copy) == before
