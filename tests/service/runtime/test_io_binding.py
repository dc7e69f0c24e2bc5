"""IO binding (KV cache kept on the session's device as OrtValues) gives exactly what numpy I/O gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from service.generation.search import GenerationResult, generate, teacher_forced_attention
from service.runtime import (
    AUTO_IO_BINDING,
    CPU,
    CUDA,
    ModelRuntime,
    to_numpy,
)
from service.runtime.row_gather import RowGather, gather_graph


@pytest.fixture(scope="module")
def numpy_io(tiny_model_repository: Path) -> ModelRuntime:
    return ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="fp32", io_binding=False)


@pytest.fixture(scope="module")
def bound(tiny_model_repository: Path) -> ModelRuntime:
    return ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="fp32", io_binding=True)


@pytest.fixture(scope="module")
def sources(trained_tiny) -> list[list[int]]:
    """Mixed lengths: 12 validation sources (3-8 tokens + EOS) and two longer ones that do not
    stop cleanly, so rows leave the batch at different steps and some hit the token limit."""
    return [s + [3] for s in trained_tiny.valid.sources[:12]] + [[4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 3], [19] * 10 + [3]]


def _same(actual: list[GenerationResult], expected: list[GenerationResult], abs_score: float = 1e-5) -> None:
    assert [(g.tokens, g.finish_reason) for g in actual] == [(g.tokens, g.finish_reason) for g in expected]
    assert [g.score for g in actual] == pytest.approx([g.score for g in expected], abs=abs_score)


@pytest.mark.parametrize(("beam_size", "max_new_tokens"), [(1, 16), (3, 16), (1, 8), (3, 8), (3, 3)])
def test_io_binding_generates_the_same(numpy_io: ModelRuntime, bound: ModelRuntime, sources,
                                       beam_size: int, max_new_tokens: int) -> None:
    expected = generate(numpy_io, sources, beam_size, max_new_tokens)
    actual = generate(bound, sources, beam_size, max_new_tokens)
    _same(actual, expected)
    if max_new_tokens == 8:  # rows leave the batch at different steps, some at the limit
        assert {g.finish_reason for g in expected} == {"eos", "length"}


def test_the_cache_stays_in_ortvalues(bound: ModelRuntime) -> None:
    assert bound.io_binding and bound.device == "cpu" and bound.gather is not None
    state = bound.encode(bound.pad([[5, 6, 3], [7, 3]]))
    assert all(isinstance(k, ort.OrtValue) for k in state.cross_keys + state.cross_values)
    assert state.attentions is None and isinstance(state.source_mask, np.ndarray)
    first = bound.decode(np.full((2, 1), bound.bos_id), state)
    assert isinstance(first.logits, np.ndarray) and first.logits.shape == (2, 1, bound.vocab_size)
    assert all(isinstance(v, ort.OrtValue) and v.device_name() == "cpu" for v in first.cache.keys + first.cache.values)
    second = bound.decode(np.array([[9], [10]]), state, first.cache)
    assert second.cache.length == 2
    picked = second.cache.select(np.array([1, 1, 0]))
    assert all(isinstance(v, ort.OrtValue) for v in picked.keys + picked.values)
    assert picked.length == 2
    np.testing.assert_array_equal(to_numpy(picked.keys[0]), to_numpy(second.cache.keys[0])[[1, 1, 0]])
    np.testing.assert_array_equal(to_numpy(picked.values[1]), to_numpy(second.cache.values[1])[[1, 1, 0]])
    state3 = state.select(np.array([1, 1, 0]))
    assert state3.source_mask.tolist() == [[True, True, False]] * 2 + [[True, True, True]]
    np.testing.assert_array_equal(to_numpy(state3.cross_values[0])[2], to_numpy(state.cross_values[0])[0])


def test_steps_match_numpy_io_with_attention(numpy_io: ModelRuntime, bound: ModelRuntime) -> None:
    source = numpy_io.pad([[5, 6, 7, 3], [8, 3]])
    expected_state, actual_state = numpy_io.encode(source, need_attention=True), bound.encode(source, need_attention=True)
    for a, e in zip(actual_state.attentions, expected_state.attentions, strict=True):  # type: ignore[arg-type]
        np.testing.assert_allclose(a, e, atol=1e-6)
    expected = numpy_io.decode(np.array([[2, 9], [2, 4]]), expected_state, need_attention=True)
    actual = bound.decode(np.array([[2, 9], [2, 4]]), actual_state, need_attention=True)
    np.testing.assert_allclose(actual.logits, expected.logits, atol=1e-5)
    for a, e in zip(actual.self_attentions + actual.cross_attentions,  # type: ignore[operator]
                    expected.self_attentions + expected.cross_attentions, strict=True):  # type: ignore[operator]
        assert isinstance(a, np.ndarray)
        np.testing.assert_allclose(a, e, atol=1e-6)
    for a, e in zip(actual.cache.keys + actual.cache.values, expected.cache.keys + expected.cache.values, strict=True):
        np.testing.assert_allclose(to_numpy(a), e, atol=1e-6)
    # an OrtValue cache handed to a numpy-I/O runtime (and back) is accepted
    mixed = numpy_io.decode(np.array([[5], [6]]), expected_state, actual.cache)
    np.testing.assert_allclose(mixed.logits, bound.decode(np.array([[5], [6]]), actual_state, expected.cache).logits,
                               atol=1e-5)


def test_teacher_forced_attention_is_the_same(numpy_io: ModelRuntime, bound: ModelRuntime) -> None:
    expected = teacher_forced_attention(numpy_io, [5, 9, 12, 7, 3], [7, 12, 9, 5])
    actual = teacher_forced_attention(bound, [5, 9, 12, 7, 3], [7, 12, 9, 5])
    for kind in ("encoder", "decoder", "cross"):
        for a, e in zip(getattr(actual, kind), getattr(expected, kind), strict=True):
            np.testing.assert_allclose(a, e, atol=1e-6)


def test_warmup_and_defaults(tiny_model_repository: Path, bound: ModelRuntime) -> None:
    bound.warmup()
    auto = ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="fp32")
    assert auto.io_binding is AUTO_IO_BINDING[CPU] and auto.device == "cpu"
    assert AUTO_IO_BINDING[CUDA] is True
    assert auto.cache_dtype == np.float32 and auto.empty_cache(3).keys[0].dtype == np.float32


def test_gather_graph_is_valid_onnx_and_gathers_any_dtype() -> None:
    onnx = pytest.importorskip("onnx")
    onnx.checker.check_model(onnx.load_from_string(gather_graph(((1, 4), (10, 2), (7, 3)))), full_check=True)
    gather = RowGather(CPU, "cpu", 0, threads=1)
    rng = np.random.default_rng(0)
    arrays: list[np.ndarray] = [rng.random((3, 2, 5, 4), dtype=np.float32), rng.random((3, 6)).astype(np.float16),
              np.arange(3 * 2 * 2, dtype=np.int64).reshape(3, 2, 2)]
    rows = np.array([2, 0, 2, 1])
    out = gather([ort.OrtValue.ortvalue_from_numpy(a) for a in arrays], rows)
    for got, array in zip(out, arrays, strict=True):
        assert got.numpy().dtype == array.dtype
        np.testing.assert_array_equal(got.numpy(), array[rows])


def _cuda_available() -> bool:
    return ort.get_device() == "GPU" and CUDA in ort.get_available_providers()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs onnxruntime-gpu with CUDAExecutionProvider")
def test_io_binding_on_cuda(tiny_model_repository: Path, trained_tiny, tiny_tokenizer: Path, sources,
                            tmp_path: Path) -> None:
    """On CUDA the cache lives on the GPU; fp32 and fp16 give the same tokens with and without IO
    binding (fp16: a tiny repository with an fp16 variant written here)."""
    from export.repository import write_repository

    repository = tmp_path / "tiny-fp16"
    write_repository(trained_tiny.load(), tiny_tokenizer, repository, task="translate", source_language="en",
                     target_language="en", variants=("fp32", "fp16"), threads=1)
    for variant in ("fp32", "fp16"):
        runtimes = [ModelRuntime.load(repository, [CUDA], variant=variant, io_binding=mode) for mode in (False, True)]
        assert all(r.provider == CUDA for r in runtimes)
        numpy_runtime, cuda_bound = runtimes
        assert cuda_bound.device == "cuda" and ModelRuntime.load(repository, [CUDA], variant=variant).io_binding
        state = cuda_bound.encode(cuda_bound.pad([[5, 6, 3]]))
        step = cuda_bound.decode(np.full((1, 1), cuda_bound.bos_id), state)
        on_gpu = step.cache.keys + state.cross_keys + step.cache.select(np.array([0, 0])).keys
        assert all(isinstance(v, ort.OrtValue) and v.device_name() == "cuda" for v in on_gpu)
        for beam_size in (1, 3):
            _same(generate(cuda_bound, sources, beam_size, 12), generate(numpy_runtime, sources, beam_size, 12),
                  abs_score=1e-3 if variant == "fp16" else 1e-4)


def test_fp16_cache_in_graph_io(tiny_model_repository: Path, sources, tmp_path: Path) -> None:
    """A variant converted without keeping float32 I/O has float16 past/present keys and values:
    the runtime takes the cache dtype from the session, in both modes."""
    import shutil

    onnx = pytest.importorskip("onnx")
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from export.storage import load_graph
    from service.repository.manifest import Variant, read_manifest, write_manifest

    repository = tmp_path / "tiny"
    shutil.copytree(tiny_model_repository, repository)
    (repository / "fp16io").mkdir()
    for graph in ("encoder", "decoder"):
        converted = convert_float_to_float16(load_graph(repository / f"{graph}.onnx"), keep_io_types=False)
        onnx.save(converted, str(repository / "fp16io" / f"{graph}.onnx"))
    manifest = read_manifest(repository)
    manifest.variants["fp16"] = Variant("fp16io/encoder.onnx", "fp16io/decoder.onnx", "fp16", [CPU], True)
    write_manifest(repository, manifest)
    runtimes = [ModelRuntime.load(repository, [CPU], threads=1, variant="fp16", io_binding=mode) for mode in (False, True)]
    assert all(r.cache_dtype == np.float16 for r in runtimes)
    assert runtimes[0].empty_cache(2).keys[0].dtype == np.float16
    for beam_size in (1, 3):
        _same(generate(runtimes[1], sources, beam_size, 8), generate(runtimes[0], sources, beam_size, 8))
