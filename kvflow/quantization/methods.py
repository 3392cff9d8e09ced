"""Quantizing a float weight at load: int8 per channel, int4 per group with a zero point.

Round-to-nearest over min/max ranges, as vLLM's and llama.cpp's on-the-fly modes do; the
calibrated producers (GPTQ, AWQ) write checkpoints that the loader reads as they are.
"""

from __future__ import annotations

import torch

from kvflow.quantization.qweight import INT4_BLOCK, QuantizedWeight


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8: scale = max|w| / 127 per output channel (or per group of inputs)."""
    n, k = weight.shape
    group = group_size or k
    w = weight.detach().float().view(n, k // group, group)
    scales = w.abs().amax(dim=-1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group stays zero
    q = torch.round(w / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.view(n, k).contiguous(), scales.contiguous(), None, 8, group, k, "int8")


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
    w = weight.detach().float().view(n, k // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = (high - low) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: q = 0, w = min
    half_scales, half_low = scales.half().float(), low.half().float()
    if bool((half_scales > 0).all() and torch.isfinite(half_scales).all() and torch.isfinite(half_low).all()):
        scales, low = half_scales, half_low
    q = torch.round((w - low.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(pack_int4(q.view(n, k)), scales.contiguous(), low.contiguous(), 4, group_size, k, "int4")


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
