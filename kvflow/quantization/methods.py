"""Quantizing a float weight at load: int8 per channel, int4 per group with a zero point.

Round-to-nearest over min/max ranges, as vLLM's and llama.cpp's on-the-fly modes do; the
calibrated producers (GPTQ, AWQ) write checkpoints that the loader reads as they are.
"""

from __future__ import annotations

import torch

from kvflow.quantization.qweight import INT4_BLOCK, QuantizedWeight


# Rows quantized at a time: the float32 copy and the few temporaries of the arithmetic are each
# at most this many values (16 MiB), not the weight's size. A 1.1B model's fused gate/up
# projection (23M values) made about 300 MB of them at once, the peak of its whole load.
_CHUNK_VALUES = 1 << 22


def _row_chunks(weight: torch.Tensor) -> list[slice]:
    """Slices of whole rows (output channels): every scale, offset and quant of a row depends on
    that row alone, so quantizing by slices gives the same values as all at once."""
    n, k = weight.shape
    step = max(1, _CHUNK_VALUES // max(k, 1))
    return [slice(start, min(n, start + step)) for start in range(0, n, step)]


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8: scale = max|w| / 127 per output channel (or per group of inputs)."""
    n, k = weight.shape
    group = group_size or k
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // group, dtype=torch.float32)
    for rows in _row_chunks(weight):
        w = weight[rows].detach().float().view(-1, k // group, group)
        s = w.abs().amax(dim=-1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group stays zero
        scales[rows] = s
        q[rows] = torch.round(w / s.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).view(-1, k)
    return QuantizedWeight(q, scales, None, 8, group, k, "int8")


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric 4-bit per group over the group's own range: q in 0..15, w ~ scale * q + min
    (llama.cpp's Q4_1 scheme, a float zero point). Unlike an integer zero point whose range
    must hold 0, every one of the 16 levels lands inside the group's values; a group already on
    such a grid (a Q4_1 block, whose step and minimum are float16 values) comes back exactly.
    Scales and minimums are rounded to float16 values, as Q4_1 stores them: a relative change
    under 2^-11 (above 2^-14; below, float16's subnormals, an absolute one under 2^-25), far
    inside a level's width; a constant group's value moves likewise. The AMX kernel then reads
    them as float16 (tiles.AMX_ROWS_HALF). A weight with a scale float16 rounds to zero (a group
    spanning under ~4e-7 that is not constant) or a value over 65,504 keeps float32's."""
    n, k = weight.shape
    groups = k // group_size
    low, high = torch.empty(n, groups, dtype=torch.float32), torch.empty(n, groups, dtype=torch.float32)
    for rows in _row_chunks(weight):
        w = weight[rows].detach().float().view(-1, groups, group_size)
        low[rows], high[rows] = w.amin(dim=-1), w.amax(dim=-1)
    scales = (high - low) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: q = 0, w = min
    half_scales, half_low = scales.half().float(), low.half().float()
    if bool((half_scales > 0).all() and torch.isfinite(half_scales).all() and torch.isfinite(half_low).all()):
        scales, low = half_scales, half_low
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    for rows in _row_chunks(weight):
        w = weight[rows].detach().float().view(-1, groups, group_size)
        q = torch.round((w - low[rows].unsqueeze(-1)) / scales[rows].unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
        packed[rows] = pack_int4(q.view(-1, k))
    return QuantizedWeight(packed, scales, low, 4, group_size, k, "int4")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> [N, K/2] bytes in GGUF's nibble order (qweight.py)."""
    n, k = q.shape
    blocks = q.view(n, k // INT4_BLOCK, INT4_BLOCK)
    low, high = blocks[..., : INT4_BLOCK // 2], blocks[..., INT4_BLOCK // 2 :]
    return (low | (high << 4)).reshape(n, k // 2).contiguous()


def quantize(weight: torch.Tensor, method: str, group_size: int | None) -> QuantizedWeight:
    if method == "int8":
        return quantize_int8(weight, group_size)
    if method == "int4":
        return quantize_int4(weight, group_size or 32)
    raise ValueError(f"quantization: cannot quantize a float weight with {method!r} at load")
