"""Rotary position embeddings with a precomputed cos/sin table.

The table holds every position up to `max_position`, so a step with arbitrary (mixed
prefill/decode) positions just indexes it: no per-step trigonometry.
The rotation is the "rotate half" (GPT-NeoX) layout that Hugging Face checkpoints use;
GGUF loaders undo llama.cpp's interleaved permutation before weights reach the model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvflow.layers import cpu_kernels


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths stretched, short ones kept."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor applied to cos/sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq, attention_scaling = compute_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attention_scaling, persistent=False)
        # float32 copies that a model's dtype cast leaves alone: the fused kernel rounds them
        # to the activation dtype itself, as the reference's `cos.to(x.dtype)` does.
        self.cos_f32, self.sin_f32 = self.cos_cache.clone(), self.sin_cache.clone()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]; may be rotated in place.

        q and k may be row-strided views into a fused QKV output (heads contiguous).
        """
        if q.is_cuda and q.dtype == k.dtype and q.stride(2) == 1 and k.stride(2) == 1:
            from kvflow.layers.triton import elementwise  # the CUDA path only: triton is imported there

            if elementwise.enabled():
                elementwise.rotary_(q, k, positions, self.cos_cache, self.sin_cache)
                return q, k
        kernels = cpu_kernels.load()
        if (
            kernels is not None
            and q.device.type == "cpu"
            and q.dtype == k.dtype
            and kernels.supports_dtype(q.dtype)
            and cpu_kernels.heads_contiguous(q) and cpu_kernels.heads_contiguous(k)
            and positions.dtype == torch.int64 and positions.is_contiguous()
        ):
            kernels.rotary_(q, k, positions, self.cos_f32, self.sin_f32)
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
