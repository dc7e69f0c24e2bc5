"""Execution provider choice: CUDA asked for where it cannot run falls back to the CPU with one
log line naming the cause."""

from __future__ import annotations

import logging
from pathlib import Path

import onnxruntime as ort
import pytest

from service.runtime import CPU, CUDA, ModelRuntime, providers


@pytest.fixture(autouse=True)
def _fresh_reason():
    providers.cuda_unavailable_reason.cache_clear()
    yield
    providers.cuda_unavailable_reason.cache_clear()


@pytest.mark.skipif(CUDA in ort.get_available_providers(), reason="the CPU build of onnxruntime only")
def test_cuda_on_the_cpu_build_falls_back_with_one_info_line_naming_the_cause(
        tiny_model_repository: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="service.runtime"):
        runtime = ModelRuntime.load(tiny_model_repository, [CUDA, CPU], threads=1)
    assert runtime.provider == CPU
    lines = [r.getMessage() for r in caplog.records if "CUDAExecutionProvider" in r.getMessage()]
    assert len(lines) == 1
    assert "CUDAExecutionProvider unavailable" in lines[0] and "CPU build" in lines[0]
    assert "pip install 'attnserve[gpu]'" in lines[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # expected on a CPU machine


def test_a_cuda_provider_library_that_cannot_load_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    library = tmp_path / providers.CUDA_PROVIDER_LIBRARY
    library.write_bytes(b"not a shared object")
    reason = providers.cuda_unavailable_reason(library)
    assert reason is not None and reason.startswith(f"{providers.CUDA_PROVIDER_LIBRARY} cannot load:")
    missing = providers.cuda_unavailable_reason(tmp_path / "libmissing.so")
    assert missing is not None and "libmissing.so" in missing


def test_cpu_only_asks_nothing_of_cuda(tiny_model_repository: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="service.runtime"):
        assert ModelRuntime.load(tiny_model_repository, [CPU], threads=1).provider == CPU
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_gpu_memory_limit_caps_each_cuda_sessions_arena() -> None:
    """`gpu_memory_limit_mb` becomes onnxruntime's CUDA provider options (bytes, grown as asked);
    every CUDA session turns TF32 off (float32 graphs multiply in float32, as on the CPU); on the
    CPU the provider is a plain name."""
    limited = providers.execution_providers(CUDA, 512)
    assert limited == [(CUDA, {"use_tf32": "0", "gpu_mem_limit": str(512 * 2**20),
                               "arena_extend_strategy": "kSameAsRequested"}), CPU]
    assert providers.execution_providers(CUDA, 0) == [(CUDA, {"use_tf32": "0"}), CPU]
    assert providers.execution_providers(CPU, 512) == [CPU]


@pytest.mark.gpu
@pytest.mark.skipif(CUDA not in ort.get_available_providers(), reason="needs onnxruntime-gpu and a GPU")
def test_the_cuda_sessions_take_the_limit(tiny_model_repository: Path) -> None:
    runtime = ModelRuntime.load(tiny_model_repository, [CUDA, CPU], threads=1, gpu_memory_limit_mb=256)
    assert runtime.provider == CUDA
    for session in (runtime.encoder, runtime.decoder):
        assert session.get_provider_options()[CUDA]["gpu_mem_limit"] == str(256 * 2**20)
        assert session.get_provider_options()[CUDA]["use_tf32"] == "0"
