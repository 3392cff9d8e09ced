"""GGUF's quantized blocks as `QuantizedWeight`s, without dequantizing to float.

Legacy formats, 32 inputs per block with an fp16 scale d (and Q4_1 an fp16 minimum m):
  Q8_0: d, 32 x int8            w = d * q
  Q4_0: d, 16 bytes of nibbles  w = d * (q - 8) = d * q + (-8 d)
  Q4_1: d, m, 16 bytes          w = d * q + m
Their quants are copied as they are (kvflow's 4-bit layout is GGUF's nibble order); only the
scales are widened to float32.

K-quants, super-blocks of 256 inputs with an fp16 d (and dmin) and small integer scales per
sub-block:
  Q4_K: 8 sub-blocks of 32, 6-bit scale sc and min m   w = (d sc) q - (dmin m), q 4-bit
  Q5_K: the same with 5-bit q                           kept as int8 values 0..31
  Q6_K: 16 sub-blocks of 16, int8 scale sc              w = (d sc) (q - 32), kept as int8
so each sub-block is one kernel group with scale d*sc and offset -dmin*m. Their bits are
rearranged into kvflow's layouts (Q4_K's nibbles pair sub-blocks differently from Q4_0's; the
5- and 6-bit values take a byte each: more memory than the file, a quarter of bf16's).

Exactness: d * sc is exact in float32 (11 x 8 significant bits), and so is its product with
q (at most 24 bits), and dmin * m; the kernel rounds only the final sum, as gguf's numpy
dequantization does, so the weights it multiplies are bit for bit `gguf.quants.dequantize`'s
(tested for every type).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.quantization.methods import pack_int4
from kvflow.quantization.qweight import QuantizedWeight

SUPER_BLOCK = 256  # inputs per K-quant super-block


@dataclass(frozen=True)
class BlockType:
    name: str
    block_inputs: int  # inputs per block (super-block for K-quants)
    block_bytes: int


# GGMLQuantizationType value -> its block geometry: the types that run as shipped.
SHIPPED_TYPES = {
    8: BlockType("Q8_0", 32, 34), 2: BlockType("Q4_0", 32, 18), 3: BlockType("Q4_1", 32, 20),
    12: BlockType("Q4_K", SUPER_BLOCK, 144), 13: BlockType("Q5_K", SUPER_BLOCK, 176),
    14: BlockType("Q6_K", SUPER_BLOCK, 210),
}  # fmt: skip
SHIPPED_NAMES = tuple(t.name for t in SHIPPED_TYPES.values())


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes per super-block -> 8 six-bit scales and 8 six-bit mins: bytes 0-3
    hold scales 0-3 (low 6 bits), 4-7 mins 0-3; scales/mins 4-7 are the low/high nibble of
    bytes 8-11 with their top 2 bits in the top bits of bytes 0-3 / 4-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 128] bytes of a Q4_K/Q5_K super-block -> [..., 256] low 4 bits: each 32-byte run
    holds sub-block 2j in its low nibbles and sub-block 2j+1 in its high ones."""
    runs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return ((runs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15).reshape(*qs.shape[:-1], 256)


def _from_k_quant(blocks: np.ndarray, name: str, n: int, k: int) -> QuantizedWeight:
    """blocks [N, K / 256, block bytes] -> the weight, one kernel group per sub-block."""
    if name == "Q6_K":  # ql[128], qh[64], 16 int8 scales, then d
        d = _f16(blocks[..., 208:210])[..., None]
        ql, qh = blocks[..., 0:128], blocks[..., 128:192]
        sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
        # Values 0-127 of a super-block: low nibbles of ql[0:64] then high nibbles (values 64-127),
        # high 2 bits from qh[0:32] at shifts 0, 2, 4, 6 (one shift per 32 values); 128-255 likewise.
        low = (ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15
        high = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
        q = (low.reshape(n, -1, 256) | (high.reshape(n, -1, 256) << 4)).astype(np.int16) - 32
        scales = (d * sc).reshape(n, k // 16)
        return QuantizedWeight(torch.from_numpy(q.astype(np.int8).reshape(n, k)), torch.from_numpy(scales), None,
                               8, 16, k, "gguf:Q6_K")
    d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]  # then 12 scale bytes, quants
    sc, m = _k_scales_mins(blocks[..., 4:16])
    scales, offsets = (d * sc).reshape(n, k // 32), (-(dmin * m)).reshape(n, k // 32)
    if name == "Q4_K":
        q = _k_nibbles(blocks[..., 16:144]).reshape(n, k)
        return QuantizedWeight(pack_int4(torch.from_numpy(np.ascontiguousarray(q))), torch.from_numpy(scales),
                               torch.from_numpy(offsets), 4, 32, k, "gguf:Q4_K")
    qh, qs = blocks[..., 16:48], blocks[..., 48:176]  # Q5_K: bit 5 of value i of sub-block j is bit j of qh[i]
    fifth = (qh.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    q = _k_nibbles(qs) | (fifth.reshape(n, -1, 256) << 4)
    return QuantizedWeight(torch.from_numpy(q.astype(np.int8).reshape(n, k)), torch.from_numpy(scales),
                           torch.from_numpy(offsets), 8, 32, k, "gguf:Q5_K")


def from_gguf_blocks(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> QuantizedWeight:
    """`raw`: the tensor's bytes [N, K / block inputs * block bytes]; `shape`: [N, K]."""
    kind = SHIPPED_TYPES[qtype]
    n, k = shape
    blocks = np.ascontiguousarray(raw).reshape(n, k // kind.block_inputs, kind.block_bytes)
    if kind.block_inputs == SUPER_BLOCK:
        return _from_k_quant(blocks, kind.name, n, k)
    d = torch.from_numpy(_f16(blocks[..., 0:2]))
    if kind.name == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
        return QuantizedWeight(q, d, None, 8, 32, k, "gguf:Q8_0")
    if kind.name == "Q4_0":
        q = torch.from_numpy(blocks[..., 2:].reshape(n, k // 2).copy())
        return QuantizedWeight(q, d, -8.0 * d, 4, 32, k, "gguf:Q4_0")
    m = torch.from_numpy(_f16(blocks[..., 2:4]))
    q = torch.from_numpy(blocks[..., 4:].reshape(n, k // 2).copy())
    return QuantizedWeight(q, d, m, 4, 32, k, "gguf:Q4_1")
