"""onnxruntime execution providers and what the service does on each: the variants it
prefers and whether it keeps tensors on the device (IO binding) by default."""

from __future__ import annotations

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
DEFAULT_PROVIDERS = (CUDA, CPU)
# Variants to try per execution provider, best first; only servable ones are taken.
VARIANT_PREFERENCE = {CUDA: ("fp16", "fp32"), CPU: ("int8", "fp32")}
# IO binding by default: on CUDA, so the KV cache stays on the GPU; not on the CPU, where numpy
# arrays and CPU OrtValues share memory and binding saves no copy
# (`python -m bench.io_binding` measures both ways).
AUTO_IO_BINDING = {CUDA: True, CPU: False}
