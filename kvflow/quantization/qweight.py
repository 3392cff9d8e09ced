"""`QuantizedWeight`: a linear layer's weight as small integers plus per-group scales.

One record covers every weight-only format kvflow runs (csrc/quant_gemm.cpp):

    w[n, k] = q[n, k] * scales[n, k // group_size] + offsets[n, k // group_size]

- `bits=8`: `qweight` int8 [N, K]; symmetric, so no offsets (per-channel int8 is one group of
  K; GGUF Q8_0 is groups of 32), except an asymmetric compressed-tensors checkpoint's
  (offsets -zero_point * scale);
- `bits=4`: `qweight` uint8 [N, K/2], two values 0..15 per byte in 32-input blocks of 16
  bytes (byte j of a block: input j in the low nibble, input 16 + j in the high one), GGUF's
  Q4_0/Q4_1 order; `offsets` carry the zero point (-scale * zero), Q4_0's -8d or Q4_1's min.

Rows are independent, so fused projections (QKV, gate/up) are quantized shards stacked
along N (`cat_rows`) and llama.cpp's q/k row permutation is undone by permuting rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

INT4_BLOCK = 32  # inputs per packed 4-bit block (16 bytes)


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor  # int8 [N, K] (bits=8) or uint8 [N, K/2] (bits=4)
    scales: torch.Tensor  # float32 [N, K / group_size]
    offsets: torch.Tensor | None  # float32 [N, K / group_size], or None for zero
    bits: int
    group_size: int
    in_features: int
    source: str  # "int8", "int4", "gguf:Q4_1", ... (what made it, for logs and reports)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes a forward pass streams for this weight (quants, scales and offsets)."""
        extra = self.offsets.numel() * 4 if self.offsets is not None else 0
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 4 + extra

    def format(self) -> tuple:
        """What must agree for two shards to be stacked into one weight."""
        return (self.bits, self.group_size, self.in_features, self.offsets is not None)

    def int_values(self) -> torch.Tensor:
        """q as float32 [N, K] (4-bit values unpacked from GGUF's nibble order)."""
        if self.bits == 8:
            return self.qweight.float()
        blocks = self.qweight.view(self.out_features, -1, INT4_BLOCK // 2)
        low, high = blocks & 0x0F, blocks >> 4
        return torch.cat([low, high], dim=-1).reshape(self.out_features, self.in_features).float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the kernel multiplies by: q * scale, then + offset, in float32 (two
        roundings, as the kernel, gguf and the producers' own dequantization do)."""
        groups = self.scales.shape[1]
        q = self.int_values().view(self.out_features, groups, self.group_size)
        w = q * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            w = w + self.offsets.unsqueeze(-1)
        return w.reshape(self.shape).to(dtype)

    def dequantize_into(self, out: torch.Tensor, rows_at_a_time: int = 4096) -> None:
        """`out.copy_(self.dequantize())` a few thousand rows at a time: the same values without a
        float32 copy of the whole weight (a 49,152-row embedding table's is 113 MB)."""
        if tuple(out.shape) != self.shape:
            raise ValueError(f"dequantize_into: out has shape {tuple(out.shape)}, the weight {self.shape}")
        for start in range(0, self.out_features, rows_at_a_time):
            end = min(self.out_features, start + rows_at_a_time)
            part = replace(self, qweight=self.qweight[start:end], scales=self.scales[start:end],
                           offsets=None if self.offsets is None else self.offsets[start:end])
            out[start:end].copy_(part.dequantize())

    def widened(self, group_size: int) -> "QuantizedWeight":
        """The same weights as int8 values with a scale and an offset (zero where this has none)
        per `group_size` inputs, a divisor of this weight's group: q * scale + offset stays the
        same two operations on the same numbers, so the kernel's weights are unchanged."""
        if self.group_size % group_size:
            raise ValueError(f"widened: {group_size} does not divide the group size {self.group_size}")
        repeat = self.group_size // group_size
        q = self.qweight if self.bits == 8 else self.int_values().to(torch.int8)
        scales = self.scales.repeat_interleave(repeat, dim=1)
        offsets = torch.zeros_like(scales) if self.offsets is None else self.offsets.repeat_interleave(repeat, dim=1)
        return QuantizedWeight(q, scales, offsets, 8, group_size, self.in_features, self.source)

    def released(self) -> QuantizedWeight:
        """This record with its tensors on the meta device: shape, format and source stay visible
        once another form (`tiles.QuantTiles`) holds the weight."""
        return replace(self, qweight=self.qweight.to("meta"), scales=self.scales.to("meta"),
                       offsets=None if self.offsets is None else self.offsets.to("meta"))

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The same weight with output rows reordered (`index` into rows)."""
        return QuantizedWeight(self.qweight[index].contiguous(), self.scales[index].contiguous(),
                               None if self.offsets is None else self.offsets[index].contiguous(),
                               self.bits, self.group_size, self.in_features, self.source)


def cat_rows(shards: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack shards along the output dimension (a fused QKV or gate/up projection).

    Shards of different formats (a GGUF Q4_K_M file keeps attn_v in Q6_K beside Q4_K q and k)
    are first widened, losslessly, to one: int8 values with a scale and offset per the largest
    group that divides every shard's (`widened`). The stacked rows cost more bytes than the
    narrowest shard, but no weight changes and none runs in float."""
    first = shards[0]
    if any(s.in_features != first.in_features for s in shards):
        raise ValueError("cannot stack quantized shards of different input sizes: "
                         + ", ".join(f"{s.source} {s.shape}" for s in shards))
    if any(s.format() != first.format() for s in shards):
        group = math.gcd(*(s.group_size for s in shards))
        sources = "+".join(dict.fromkeys(s.source for s in shards))
        shards = [replace(s.widened(group), source=sources) for s in shards]
        first = shards[0]
    offsets = None if first.offsets is None else torch.cat([s.offsets for s in shards])
    return QuantizedWeight(torch.cat([s.qweight for s in shards]), torch.cat([s.scales for s in shards]), offsets,
                           first.bits, first.group_size, first.in_features, first.source)