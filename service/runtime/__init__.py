"""The model on onnxruntime: sessions of a verified model repository (`model_runtime`), the
tensors its graph calls hand over (`tensors`), the step graph's slot buffers in host memory
(`step_buffers`) and on the device (`device_slots`), row selection on the device
(`row_gather`), the writer of those tiny graphs (`onnx_proto`) and the execution providers
(`providers`). The names below are the package's public API."""

from service.runtime.model_runtime import ModelError, ModelLoadError, ModelRuntime
from service.runtime.providers import (
    AUTO_IO_BINDING,
    CPU,
    CUDA,
    DEFAULT_PROVIDERS,
    VARIANT_PREFERENCE,
)
from service.runtime.step_buffers import CacheBuffers, run_step
from service.runtime.tensors import (
    DecoderStep,
    EncoderState,
    Gatherer,
    KVCache,
    Tensor,
    shape,
    to_numpy,
)

__all__ = [
    "AUTO_IO_BINDING", "CPU", "CUDA", "DEFAULT_PROVIDERS", "VARIANT_PREFERENCE", "CacheBuffers", "DecoderStep",
    "EncoderState", "Gatherer", "KVCache", "ModelError", "ModelLoadError", "ModelRuntime", "Tensor", "run_step",
    "shape", "to_numpy",
]
