"""Quantized weights packed in the bf16 GEMM's tiles, and the linear op that runs on them.

A quantized layer with bf16 activations runs csrc/quant_gemm_bf16.cpp in the bf16 GEMM's
16-column tiles. On CPUs with AVX512-BF16: the integers themselves are vdpbf16ps's bf16 operands
(exact; a 4-bit q as 128 + q, one bitwise operation from its nibble) and each group's sum is
scaled and offset in float32. No weight is rounded to bf16, so the result is
sum_k x * (q * s + o) up to float32 rounding, the same for a row whatever rows share the call.
Unpacking costs 2 (4-bit) or 2.5 (int8) vector operations per 32 weights, against ~11 and ~7
for dequantizing to float32 and rounding to bf16, which is what lets a quantized decode step run
at memory speed; prefill runs at about the bf16 GEMM's rate (two more FMAs per 16 columns and
group). On CPUs with AVX2 and FMA but no AVX512-BF16, csrc/quant_gemm_avx2.h does vdpbf16ps's
work as two FMAs per pair under DAZ/FTZ, in the same order: the same bits on every machine type
without AMX. On AMX (csrc/quant_gemm_amx.h) long groups keep these sums; groups of under 256
inputs multiply the dequantized weights rounded to bf16 (csrc/quant_gemm_amx_folded.h), which
gives the bf16 layer's bits for those weights and prefill at the bf16 GEMM's rate. 4-bit weights
in such groups are then packed in their own layout (AMX_ROWS: the weights as the tile product's
A operand, csrc/quant_gemm_amx_rows.h), where dequantizing is a lookup in a 16-entry table per
column and group: the same bits, at about 0.6x the arithmetic, which a decode step's one row
otherwise pays in full. Where every scale and offset is a float16 value (a GGUF file's always,
`methods.quantize_int4`'s by construction) they travel as float16 inside the quant stream
(AMX_ROWS_HALF): a sixth fewer bytes for groups of 32, which a decode step reads once each. The
AVX512-BF16 and AVX2 + F16C kernels read them as float16 too (PAIRS_HALF, beside the k-pair
quants), widened to the same float32 values: the same bits, a sixth fewer bytes.
quant_gemm.cpp (row layout, float32 dot products) stays the path for float32 activations and
for CPUs without AVX2.

`QuantTiles` is made once at load from a `QuantizedWeight` (the row layout every checkpoint
format becomes) and replaces it: the row-layout tensors are released, so the weight is held once.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from kvflow.layers import cpu_kernels
from kvflow.quantization.qweight import QuantizedWeight

TILE_COLS = 16  # output columns per tile, as in the bf16 GEMM (csrc/gemm_blocking.h)
# how a tile's quants are ordered (csrc/quant_gemm_avx2.h's kQuantPairs, kQuantAmxRows, kQuantAmxRowsHalf,
# kQuantPairsHalf)
PAIRS, AMX_ROWS, AMX_ROWS_HALF, PAIRS_HALF = 0, 1, 2, 3


@dataclass
class QuantTiles:
    """A `QuantizedWeight` in tile order (csrc/quant_gemm_bf16.cpp describes the layout)."""

    q: torch.Tensor  # uint8 [ceil(N/16) * K/2 * (32 or 16)] (AMX_ROWS_HALF: with the scales and offsets)
    scales: torch.Tensor  # float32 [ceil(N/16), K / group_size, 16] (PAIRS_HALF: float16; AMX_ROWS_HALF: empty)
    offsets: torch.Tensor | None  # the same shape; 4 bits: always (zeros for none; AMX_ROWS_HALF: None)
    bits: int
    group_size: int
    in_features: int
    out_features: int
    layout: int = PAIRS  # AMX_ROWS(_HALF): only the AMX kernel reads it (packed while AMX runs the GEMMs)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.offsets) if t is not None)


@functools.cache
def _library() -> ctypes.CDLL | None:
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.lib.kvflow_has_quant_gemm_bf16():
        return None
    return _bind(kernels.lib)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvflow_quant_tiles_bytes.argtypes = [ctypes.c_int, ctypes.c_int, i64, i64, i64]
    lib.kvflow_quant_tiles_bytes.restype = i64
    lib.kvflow_quant_tiles_layout.argtypes = [ctypes.c_int, i64, i64, ctypes.c_int]
    lib.kvflow_quant_tiles_layout.restype = ctypes.c_int
    lib.kvflow_pack_quant_tiles.argtypes = [ctypes.c_int, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr]
    lib.kvflow_pack_quant_tiles.restype = ctypes.c_int
    lib.kvflow_quant_gemm_bf16.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr,
                                           i64, i64, ptr, ptr, i64]
    lib.kvflow_quant_gemm_bf16.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether this machine runs the tile kernel (AVX512-BF16 or AVX2 + FMA, the CPU kernels built)."""
    return _library() is not None


def supports(weight: QuantizedWeight) -> bool:
    """Layouts the tile packing takes: groups of whole k quads (every format kvflow reads)."""
    k, group = weight.in_features, weight.group_size
    return weight.bits in (4, 8) and group % 4 == 0 and k % group == 0 and (weight.bits == 8 or k % 32 == 0)


def float16_values(t: torch.Tensor | None) -> bool:
    """Whether every element of `t` (None: zeros) is a finite float16 value, so float16 holds
    it exactly (the packer's test, csrc/quant_gemm_bf16.cpp's float16_bits)."""
    return t is None or bool(torch.isfinite(t).all() and torch.equal(t.float().half().float(), t.float()))


@dataclass(frozen=True)
class _Plan:
    """What `pack` will make of a weight: its layout and its tensors' sizes."""

    layout: int
    q_bytes: int
    scales_shape: tuple[int, ...]
    offsets: bool

    @property
    def scales_dtype(self) -> torch.dtype:
        return torch.float16 if self.layout == PAIRS_HALF else torch.float32

    @property
    def nbytes(self) -> int:
        """All of it, each tensor starting 64-byte aligned (as placed in a shared buffer)."""
        factors = _aligned(math.prod(self.scales_shape) * self.scales_dtype.itemsize)
        return _aligned(self.q_bytes) + factors * (2 if self.offsets else 1)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _plan(weight: QuantizedWeight, lib: ctypes.CDLL) -> _Plan:
    if not supports(weight):
        raise ValueError(f"quantized tiles: groups of {weight.group_size} over {weight.in_features} inputs")
    n, k = weight.out_features, weight.in_features
    half = float16_values(weight.scales) and float16_values(weight.offsets)
    layout = lib.kvflow_quant_tiles_layout(weight.bits, weight.group_size, k, int(half))
    if layout == AMX_ROWS_HALF:  # the scales and offsets travel in q
        return _Plan(layout, lib.kvflow_quant_tiles_bytes(weight.bits, layout, weight.group_size, n, k), (0,), False)
    return _Plan(layout, lib.kvflow_quant_tiles_bytes(weight.bits, layout, weight.group_size, n, k),
                 (-(-n // TILE_COLS), k // weight.group_size, TILE_COLS), weight.offsets is not None or weight.bits == 4)


def _require(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or _library()
    if lib is None:
        raise RuntimeError("quantized tiles need kvflow's CPU kernels on a CPU with AVX512-BF16 or AVX2 + FMA")
    return lib


def packed_bytes(weight: QuantizedWeight, lib: ctypes.CDLL | None = None) -> int:
    """The size of the `out` buffer `pack(weight, out=...)` fills: a decode step streams every
    weight, so the loader places all of them in one buffer on 2 MiB pages
    (`layers.linear.pack_linear_weights`)."""
    return _plan(weight, _require(lib)).nbytes


def pack(weight: QuantizedWeight, lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None) -> QuantTiles:
    """The tile form of `weight` (its tensors are only read), in the layout the kernels want now:
    AMX_ROWS (AMX_ROWS_HALF where the scales and offsets are float16 values) for 4-bit weights in
    short groups while AMX runs the GEMMs; else PAIRS_HALF where they are float16 values and the
    AVX512-BF16 or AVX2 + F16C kernel runs; else PAIRS. Its tensors are views of `out` (uint8,
    `packed_bytes(weight)` of them) when given. `lib` is for tests (an emulated build)."""
    lib = _require(lib)
    plan = _plan(weight, lib)
    n, k = weight.out_features, weight.in_features
    if out is not None and (out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != plan.nbytes
                            or not out.is_contiguous()):
        raise ValueError(f"quantized tiles: `out` must be {plan.nbytes} contiguous bytes in one dimension, not "
                         f"{tuple(out.shape)} of {out.dtype}")
    carved = 0

    def tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nonlocal carved
        if out is None:
            return torch.empty(shape, dtype=dtype)
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        view = out[carved: carved + size].view(dtype).view(shape)
        carved += _aligned(size)
        return view

    q = tensor((plan.q_bytes,), torch.uint8)
    scales = tensor(plan.scales_shape, plan.scales_dtype)
    offsets = tensor(plan.scales_shape, plan.scales_dtype) if plan.offsets else None
    src_q, src_scales = weight.qweight.contiguous(), weight.scales.float().contiguous()  # held across the call
    src_offsets = None if weight.offsets is None else weight.offsets.float().contiguous()
    rc = lib.kvflow_pack_quant_tiles(weight.bits, plan.layout, src_q.data_ptr(), src_scales.data_ptr(),
                                     None if src_offsets is None else src_offsets.data_ptr(), weight.group_size, n, k,
                                     q.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr())
    cpu_kernels.check_rc(rc, "pack_quant_tiles")
    return QuantTiles(q, scales, offsets, weight.bits, weight.group_size, k, n, plan.layout)


def prepare(tiles: QuantTiles, bias: torch.Tensor | None = None, float32_out: bool = False,
            lib: ctypes.CDLL | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """y = x @ dequant(W)^T (+ bias) for bf16 x [M, K], everything but x bound once (a decode
    step makes ~120 such calls). The bias is rounded to bf16, as the bf16 model's is; with
    `float32_out` the output is the float32 accumulator (the LM head's logits)."""
    lib = _require(lib)
    out_dtype = torch.float32 if float32_out else torch.bfloat16
    bias_t = None if bias is None else bias.detach().to(torch.bfloat16).to(out_dtype).contiguous()
    k, n = tiles.in_features, tiles.out_features
    fixed = (tiles.bits, tiles.layout, tiles.q.data_ptr(), tiles.scales.data_ptr(),
             None if tiles.offsets is None else tiles.offsets.data_ptr(), tiles.group_size, n,
             None if bias_t is None else bias_t.data_ptr())
    code = 0 if float32_out else 1
    fn = lib.kvflow_quant_gemm_bf16

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise TypeError(f"this quantized Linear runs on bf16 tiles and got {x.dtype} input on {x.device}")
        rows = x if x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == k else x.reshape(-1, k).contiguous()
        out = torch.empty(rows.shape[0], n, dtype=out_dtype)
        rc = fn(code, rows.data_ptr(), rows.shape[0], k, rows.stride(0), *fixed, out.data_ptr(), n)
        if rc:
            cpu_kernels.check_rc(rc, "quant_gemm_bf16")
        return out if rows is x else out.view(*x.shape[:-1], n)

    run.keep = (tiles, bias_t)  # the pointers above stay valid as long as the op lives
    return run
