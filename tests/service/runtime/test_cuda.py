"""The default models on the CUDA execution provider (`make gpu-check` runs these; they skip
without a CUDA build of onnxruntime and a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from service.generation.search import generate
from service.runtime import CPU, CUDA, ModelRuntime

MODELS = Path(__file__).resolve().parents[3] / "models"
TEXTS = Path(__file__).resolve().parents[2] / "fixtures" / "default_models"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ort.get_device() != "GPU" or CUDA not in ort.get_available_providers(),
                       reason="needs onnxruntime-gpu with CUDAExecutionProvider and a GPU"),
]


def _sources(runtime: ModelRuntime, model: str, count: int = 32) -> list[list[int]]:
    lines = (TEXTS / model / "test.src").read_text(encoding="utf-8").splitlines()[:count]
    return [runtime.tokenizer.encode(line)[: runtime.max_source_len - 1] + [runtime.eos_id] for line in lines]


@pytest.mark.parametrize("model", ["translate-en-it", "summarize-en"])
def test_fp32_on_cuda_gives_the_cpus_greedy_tokens(model: str) -> None:
    cuda = ModelRuntime.load(MODELS / model, [CUDA], variant="fp32")
    cpu = ModelRuntime.load(MODELS / model, [CPU], variant="fp32")
    assert (cuda.provider, cuda.io_binding, cuda.device) == (CUDA, True, "cuda")
    sources = _sources(cpu, model)
    on_cuda = generate(cuda, sources, 1, 64, greedy_scores=False)
    on_cpu = generate(cpu, sources, 1, 64, greedy_scores=False)
    assert [r.tokens for r in on_cuda] == [r.tokens for r in on_cpu]


def test_the_cache_stays_on_the_device_between_steps(tmp_path: Path) -> None:
    """onnxruntime's profiler counts the copies between host and device: per decoder call, the
    fed token ids and the logits cross, and no layer's keys or values do."""
    runtime = ModelRuntime.load(MODELS / "translate-en-it", [CUDA], variant="fp32",
                                profile_prefix=str(tmp_path / "profile"))
    sources = _sources(runtime, "translate-en-it", 8)
    results = generate(runtime, sources, 1, 32, greedy_scores=False)
    steps = max(len(r.tokens) for r in results)
    profile = Path(runtime.decoder.end_profiling())
    events = json.loads(profile.read_text())
    copies = [e for e in events if e.get("cat") == "Node" and "Memcpy" in str(e.get("args", {}).get("op_name", ""))]
    layers = runtime.n_decoder_layers
    assert len(copies) < steps * 2 * layers, f"{len(copies)} host-device copies in {steps} steps"


def test_serving_reports_the_cuda_provider() -> None:
    runtime = ModelRuntime.load(MODELS / "translate-en-it", [CUDA, CPU])
    assert runtime.provider == CUDA
    assert runtime.variant in runtime.manifest.variants
    state = runtime.encode(runtime.pad([[5, 6, runtime.eos_id]]))
    assert isinstance(state.cross_keys[0], ort.OrtValue) and state.cross_keys[0].device_name() == "cuda"
    assert np.isfinite(runtime.decode(np.full((1, 1), runtime.bos_id), state).logits).all()


@pytest.mark.parametrize("model", ["translate-en-it", "summarize-en"])
def test_fp16_on_cuda_batches_on_its_step_graph(model: str) -> None:
    """CUDA serves the fp16 variant, and continuous batching on its step graph (asked for here,
    served by default too: float16 caches, which CUDA's attention kernel takes), the slots on the
    GPU; float16 arithmetic may move a close call, so most rows, not all, decode the CPU's fp32 tokens."""
    from service.batching.slot_batch import SlotBatch

    cuda = ModelRuntime.load(MODELS / model, [CUDA, CPU], step_graph=True)
    assert (cuda.provider, cuda.variant) == (CUDA, "fp16") and cuda.step is not None
    cpu = ModelRuntime.load(MODELS / model, [CPU], variant="fp32")
    sources = _sources(cpu, model)
    batch: SlotBatch[int] = SlotBatch(cuda)
    assert batch.on_device
    batch.concatenate(sources, list(range(len(sources))), [64] * len(sources))
    results: dict = {}
    while len(batch):
        results.update(batch.generate_token())
    expected = generate(cpu, sources, 1, 64, greedy_scores=False)
    identical = sum(results[i].tokens == e.tokens for i, e in enumerate(expected))
    assert identical >= 3 * len(sources) // 4, f"{identical} of {len(sources)} rows"
