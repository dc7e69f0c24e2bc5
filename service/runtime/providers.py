"""onnxruntime execution providers and what the service does on each: the variants it
prefers, whether it keeps tensors on the device (IO binding) by default, and why CUDA cannot
run when it cannot."""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import onnxruntime as ort

logger = logging.getLogger(__name__)

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
DEFAULT_PROVIDERS = (CUDA, CPU)
# Variants to try per execution provider, best first; only servable ones are taken.
VARIANT_PREFERENCE = {CUDA: ("fp16", "fp32"), CPU: ("int8", "fp32")}
# IO binding by default: on CUDA, so the KV cache stays on the GPU; not on the CPU, where numpy
# arrays and CPU OrtValues share memory and binding saves no copy
# (`python -m bench.io_binding` measures both ways).
AUTO_IO_BINDING = {CUDA: True, CPU: False}
# Cache types of the step graph (`decoder_step.onnx`) whose GroupQueryAttention has a kernel on
# the provider. onnxruntime's CUDA kernel takes float16 (and bfloat16) only: a float32 step graph
# on CUDA would run its attention on the CPU, copying every layer's cache both ways at each step,
# so the runtime serves it on the merged decoder instead (`ModelRuntime.load`'s `step_graph`).
STEP_CACHE_TYPES = {CUDA: ("tensor(float16)",), CPU: ("tensor(float)", "tensor(float16)", "tensor(int8)")}
# Whether a provider serves a usable step graph unless told not to (`step_graph`); both do since
# `make gpu-check` saw the fp16 step graph on CUDA decode the CPU's tokens.
STEP_GRAPH_BY_DEFAULT = {CUDA: True, CPU: True}

CUDA_PROVIDER_LIBRARY = "libonnxruntime_providers_cuda.so"


def prepare_cuda() -> None:
    """Load the CUDA and cuDNN libraries of the nvidia-* Python packages, when installed, so the
    CUDA provider finds them without LD_LIBRARY_PATH (onnxruntime-gpu's `preload_dlls`)."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None and CUDA in ort.get_available_providers():
        try:
            preload()
        except (OSError, RuntimeError, ImportError) as error:  # the provider may still find system libraries
            logger.debug("onnxruntime.preload_dlls: %s", error)


@functools.cache
def cuda_unavailable_reason(library: Path | None = None) -> str | None:
    """Why onnxruntime cannot run on CUDA here, in one line, or None when it can try: the CPU
    build of onnxruntime is installed, or its CUDA provider library cannot load (the loader's
    message names the missing CUDA/cuDNN library or symbol)."""
    if CUDA not in ort.get_available_providers():
        return (f"onnxruntime {ort.__version__} is the CPU build; install the CUDA build with "
                f"pip install 'attnserve[gpu]' (it replaces onnxruntime with onnxruntime-gpu)")
    capi = Path(ort.__file__).parent / "capi"
    library = library or capi / CUDA_PROVIDER_LIBRARY
    try:
        shared = capi / "libonnxruntime_providers_shared.so"
        if shared.exists():
            ctypes.CDLL(str(shared), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(library))
    except OSError as error:
        return f"{library.name} cannot load: {error}"
    return None


def execution_providers(provider: str, gpu_memory_limit_mb: int = 0) -> list[str | tuple[str, dict[str, str]]]:
    """The providers of a model session on `provider`: the CPU alone, or CUDA with the CPU
    for the nodes CUDA has no kernel for. `gpu_memory_limit_mb` > 0 caps onnxruntime's CUDA
    memory arena of the session at that many MiB, grown only as far as asked (each session has its
    own arena: a model's encoder, decoder and step graph each get the cap)."""
    if provider == CPU:
        return [CPU]
    if provider == CUDA:
        options = {"use_tf32": "0"}  # float32 products in float32: the fp32 variant computes what the CPU computes
        if gpu_memory_limit_mb > 0:
            options |= {"gpu_mem_limit": str(gpu_memory_limit_mb << 20), "arena_extend_strategy": "kSameAsRequested"}
        return [(CUDA, options), CPU]
    return [provider, CPU]


def session_options(threads: int, spinning: bool = True, memory_arena: bool = True,
                    fold_dequantize: bool = False, profile_prefix: str | None = None) -> ort.SessionOptions:
    """The options of every model session: all graph optimizations, `threads` intra-op threads
    and a sequential executor, the CPU arena as asked, constant folding of dequantized weights
    (`fold_dequantize`, int8 graphs), optional profiling and sleeping idle threads."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1  # sequential executor: one graph call uses intra-op threads only
    # Without the arena each call's buffers go back to the allocator: the arena keeps the largest
    # batch's buffers for good (a server's RSS then follows its worst batch).
    options.enable_cpu_mem_arena = memory_arena
    if fold_dequantize:
        # onnxruntime leaves DequantizeLinear of constant weights unfolded so that QDQ fusions can
        # see them. Our int8 graphs are dynamically quantized (no QDQ fusion applies), and one such
        # node, for the output projection tied to the embedding, would rebuild its 2M float
        # weights at every decoder step. Without the QDQ passes, constant folding does it once:
        # the same tokens, a faster step (bench/results/decoder_profile_cpu.json).
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    if not spinning:  # idle intra-op threads sleep instead of busy-waiting for the next call
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options
