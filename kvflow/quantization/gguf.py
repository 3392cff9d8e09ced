"""GGUF's Q8_0, Q4_0 and Q4_1 blocks as `QuantizedWeight`s, without dequantizing.

Each format is 32 inputs per block with an fp16 scale d (and Q4_1 an fp16 minimum m):
  Q8_0: d, 32 x int8            w = d * q
  Q4_0: d, 16 bytes of nibbles  w = d * (q - 8) = d * q + (-8 d)
  Q4_1: d, m, 16 bytes          w = d * q + m
The quants are copied as they are (kvflow's 4-bit layout is GGUF's nibble order); only the
scales are widened to float32. d * q is exact in float32 (an 11-bit mantissa times 4 or 8
bits), so the kernel's weights are bit for bit those of `gguf.quants.dequantize`.
"""

from __future__ import annotations

import numpy as np
import torch

from kvflow.quantization.qweight import QuantizedWeight

# GGMLQuantizationType value -> name, bytes per 32-input block
SHIPPED_TYPES = {8: ("Q8_0", 34), 2: ("Q4_0", 18), 3: ("Q4_1", 20)}


def from_gguf_blocks(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> QuantizedWeight:
    """`raw`: the tensor's bytes [N, K / 32 * block bytes]; `shape`: [N, K]."""
    name, block_bytes = SHIPPED_TYPES[qtype]
    n, k = shape
    blocks = np.ascontiguousarray(raw).reshape(n, k // 32, block_bytes)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if name == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
        return QuantizedWeight(q, d, None, 8, 32, k, "gguf:Q8_0")
    if name == "Q4_0":
        q = torch.from_numpy(blocks[..., 2:].reshape(n, k // 2).copy())
        return QuantizedWeight(q, d, -8.0 * d, 4, 32, k, "gguf:Q4_0")
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    q = torch.from_numpy(blocks[..., 4:].reshape(n, k // 2).copy())
    return QuantizedWeight(q, d, m, 4, 32, k, "gguf:Q4_1")
