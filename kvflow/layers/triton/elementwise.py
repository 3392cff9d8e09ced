"""Fused elementwise kernels of the CUDA path: residual add + RMSNorm, SiLU·mul, rotary.

In a decode step each of these is a handful of tiny PyTorch kernels per layer (RMSNorm alone is
about nine), and at batch sizes where a step is bound by reading the weights, a few microseconds
per tiny kernel adds up to a large share of the step even inside a CUDA graph. Each kernel here
is one pass over its rows, with the PyTorch path's roundings where it rounds (the residual sum and
the normalised row to the model dtype before the weight; SiLU's output before the product).
The modules call them for CUDA tensors only (`KVFLOW_TRITON_ELEMENTWISE=0`: the PyTorch path).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def enabled() -> bool:
    return os.environ.get("KVFLOW_TRITON_ELEMENTWISE", "1") != "0"


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the new residual, rounded as torch's add
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, 0) / N + eps)
    normed = (x32 * inv).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or with a residual (norm(residual + x), residual + x), the residual updated in
    place (as the CPU kernel does). Rows are the last dimension; each row's elements contiguous."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty(rows.shape, dtype=weight.dtype, device=x.device)
    res = residual.reshape(-1, n) if residual is not None else rows
    if rows.stride(-1) != 1 or res.stride(-1) != 1 or (residual is not None and res.data_ptr() != residual.data_ptr()):
        raise ValueError("add_rms_norm: rows must be contiguous views")
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, rows.stride(0), res.stride(0), out.stride(0), eps,
            N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None, num_warps=4 if n <= 4096 else 8)
    out = out.view(x.shape)
    return out if residual is None else (out, residual)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu's output, in the model dtype
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> silu(gate) * up, [..., d]."""
    d = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * d)
    if rows.stride(-1) != 1:
        raise ValueError("silu_and_mul: rows must be contiguous")
    out = torch.empty((rows.shape[0], d), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(d))
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](rows, out, rows.stride(0), out.stride(0),
                                                                     D=d, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], d)


@triton.jit
def _rotate_heads(base, token, stride_t, stride_h, cos, sin, HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate the HEADS heads of one token at `base` in place (neox style: halves, not pairs)."""
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < HEADS)[:, None] & (i < HALF)[None, :]
    first = base + token * stride_t + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, positions, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_cos, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    # cos/sin rows are cat(freqs, freqs): the first half serves both halves of a head.
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, HALF, BLOCK_H, BLOCK_HALF)


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
            sin_cache: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place (heads' dims contiguous, rows may be strided
    views into a fused QKV output) at `positions`, with cos/sin caches [max_position, D]."""
    num_tokens, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_cache.stride(1) != 1 or sin_cache.stride(0) != cos_cache.stride(0):
        raise ValueError("rotary_: head dims and cache rows must be contiguous")
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            q, k, positions, cos_cache, sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos_cache.stride(0), NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HALF=half,
            BLOCK_H=triton.next_power_of_2(max(num_heads, k.shape[1])), BLOCK_HALF=triton.next_power_of_2(half),
            num_warps=4)
