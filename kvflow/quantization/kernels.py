"""y = x @ dequant(W)^T (+ bias) for a `QuantizedWeight`: kvflow's C++ kernel, or PyTorch.

The C++ kernel (csrc/quant_gemm.cpp) reads the integers directly, which is the point: a
decode step streams 1 or 0.5 bytes per weight instead of 2 or 4. It is batch invariant
(a token's output does not depend on the rows beside it) and its AVX2 and portable paths
give the same bits. The PyTorch path dequantizes the whole weight on every call: correct
everywhere (another device, no compiler, KVFLOW_CPU_KERNELS=0), and slow.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch
import torch.nn.functional as F

from kvflow.layers import cpu_kernels
from kvflow.quantization.qweight import QuantizedWeight


@functools.cache
def _entry_point():
    kernels = cpu_kernels.load()
    if kernels is None:
        return None
    fn = kernels.lib.kvflow_quant_gemm
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ptr, i64, i64, i64, ctypes.c_int, ptr, ptr, ptr, i64, i64, ptr, ptr, i64,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def kernel_available() -> bool:
    return _entry_point() is not None


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 portable: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`portable` forces the kernel's scalar path (tests compare it with the SIMD one).
    `out_dtype=torch.float32` with bf16 x returns the float32 accumulator unrounded (logits)."""
    fn = _entry_point()
    out_dtype = out_dtype or x.dtype
    if fn is None or x.device.type != "cpu" or x.dtype not in cpu_kernels.DTYPE_CODES:
        if out_dtype == x.dtype:
            return F.linear(x, weight.dequantize(x.dtype), bias)
        return F.linear(x.to(out_dtype), weight.dequantize(out_dtype), None if bias is None else bias.to(out_dtype))
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.out_features, dtype=out_dtype)
    if bias is not None:
        bias = bias.detach().float().contiguous()
    offsets = weight.offsets.data_ptr() if weight.offsets is not None else None
    rc = fn(cpu_kernels.DTYPE_CODES[x.dtype], cpu_kernels.DTYPE_CODES[out_dtype], rows.data_ptr(), rows.shape[0], weight.in_features, rows.stride(0),
            weight.bits, weight.qweight.data_ptr(), weight.scales.data_ptr(), offsets, weight.group_size,
            weight.out_features, None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            int(portable))
    cpu_kernels.check_rc(rc, "quant_gemm")
    return out.view(*x.shape[:-1], weight.out_features)


def prepare(weight: QuantizedWeight, bias: torch.Tensor | None = None, float32_out: bool = False
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`quant_linear` with everything but x bound once: a decode step makes ~120 of these calls,
    and resolving pointers and checks per call cost about 20 us each (2.4 ms a step).
    `float32_out`: the output in float32 whatever x's dtype (the LM head's logits)."""
    fn = _entry_point()
    if fn is None:
        return functools.partial(quant_linear, weight=weight, bias=bias,
                                 out_dtype=torch.float32 if float32_out else None)
    bias32 = None if bias is None else bias.detach().float().contiguous()
    fixed = (weight.bits, weight.qweight.data_ptr(), weight.scales.data_ptr(),
             None if weight.offsets is None else weight.offsets.data_ptr(), weight.group_size, weight.out_features,
             None if bias32 is None else bias32.data_ptr())
    k, n, codes = weight.in_features, weight.out_features, cpu_kernels.DTYPE_CODES

    def run(x: torch.Tensor) -> torch.Tensor:
        code = codes.get(x.dtype)
        out_dtype = torch.float32 if float32_out else x.dtype
        if code is None or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != k or x.device.type != "cpu":
            return quant_linear(x, weight, bias, out_dtype=out_dtype)
        out = torch.empty(x.shape[0], n, dtype=out_dtype)
        rc = fn(code, codes[out_dtype], x.data_ptr(), x.shape[0], k, x.stride(0), *fixed, out.data_ptr(), n, 0)
        if rc:
            cpu_kernels.check_rc(rc, "quant_gemm")
        return out

    run.keep = (weight, bias32)  # the pointers above stay valid as long as the op lives
    return run
