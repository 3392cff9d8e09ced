"""Which device the engine runs on, and what it must offer, checked at start-up.

`device="auto"` takes the GPU when torch sees one, else the CPU (`KVFLOW_DEVICE=cpu|cuda`
decides for "auto" instead: tests/conftest.py pins the CPU, so the suite's CPU tests stay on the
CPU on a GPU machine, and the CUDA tests ask for cuda by name). Nothing here imports anything
CUDA-only: torch's CUDA queries answer False on a CPU build, and triton is imported only once
the CUDA backend is chosen (`layers/cuda_attention.py`).
"""

from __future__ import annotations

import os

import torch

DEVICES = ("auto", "cpu", "cuda")
# vLLM's default share of the GPU for weights, activations and the KV pool.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto", "cpu" or "cuda" (the current GPU; "cuda:N" for another) as a torch device, refusing a
    GPU torch cannot use."""
    name = str(device).lower()
    kind = name.split(":", 1)[0]
    if kind not in DEVICES or (kind != "cuda" and ":" in name):
        raise ValueError(f"device: {device!r} is not supported; choose auto, cpu or cuda")
    if kind == "auto":
        pinned = os.environ.get("KVFLOW_DEVICE", "").strip().lower()
        if pinned and pinned != "auto":  # what "auto" means here (the test suite pins cpu)
            return resolve_device(pinned)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"device={device!r} (--device cuda): torch {torch.__version__} ({build}) sees no CUDA GPU "
                         "(torch.cuda.is_available() is False); run with --device cpu, or on a machine with a GPU")
    return torch.device(name if ":" in name else kind)


def check_cuda_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """A GPU without bf16 (compute capability below 8.0) is refused for bf16, the default."""
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"dtype=bfloat16 (the default with --dtype auto): {torch.cuda.get_device_name(device)} "
                         f"(compute capability {major}.{minor}) has no bf16; pass --dtype float16 or float32")


def check_triton() -> None:
    """The CUDA backend's kernels are written in Triton."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"device=cuda needs triton for its attention kernels ({exc}); "
                         "pip install 'kvflow[cuda]'") from exc


def check_cuda_engine(config, device: torch.device, dtype: torch.dtype) -> None:
    """Everything an EngineConfig asks that the CUDA backend cannot do yet, refused by its setting."""
    check_triton()
    check_cuda_dtype(device, dtype)
    if config.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} runs on the CPU backend only; "
                         "use --kv-cache-dtype auto with --device cuda")
    if config.speculative_config is not None:
        raise ValueError("speculative_config: speculative decoding runs on the CPU backend only for now; "
                         "leave it unset with --device cuda")
    if config.quantization not in (None, "none"):
        raise ValueError(f"quantization={config.quantization!r}: the integer GEMM kernels are the CPU's; "
                         "with --device cuda leave it unset (quantized checkpoints then run dequantized)")
    if config.memory_utilization is not None:
        raise ValueError("memory_utilization is a share of host memory (the CPU backend's setting); "
                         "with --device cuda set gpu_memory_utilization or kv_cache_memory")


def cuda_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the GPU now, as the driver reports them."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)
