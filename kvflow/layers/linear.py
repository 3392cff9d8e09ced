"""Dense projections whose weights are packed once, at load time, for the CPU.

`F.linear` hands oneDNN a plain [out, in] weight, which oneDNN reorders into its blocked
layout on every call; at the few rows of a decode step that reorder costs as much as the
product. `pack_linear_weights` packs each weight once, after the final dtype cast:
  - kvflow's own GEMM (`cpu_kernels.gemm`) for bf16 and float32 on a CPU with AVX-512 (bf16:
    AVX512-BF16) or AVX2 + FMA (csrc/gemm_avx2.h, the same bits): measured on AVX-512 1.2-2x
    faster than oneDNN at 1-32 rows in bf16 (1.1-1.8x in float32) and level with or slightly
    ahead of it at 2,048; its summation order does not depend on the number of rows, so a
    token's output is the same alone or batched;
  - otherwise oneDNN's prepacked weight (1.5-2x faster than `F.linear` at 1-32 rows; bf16
    results bit-identical to `F.linear`, float32 differing only in summation order);
  - the plain weight where neither applies (not the CPU, KVFLOW_PACKED_LINEAR=0).
A quantized `Linear` (kvflow/quantization) holds a `QuantizedWeight` instead and runs the
integer kernel; its plain weight is gone. In a bf16 model on a CPU with AVX512-BF16 or AVX2, packing
turns the quantized weight into the bf16 GEMM's tiles (`quantization/tiles.py`: exactly the bf16
GEMM on the dequantized weight, as fast in prefill, half or a quarter of the bytes in decode);
elsewhere it runs the row-layout kernel (`quantization/kernels.py`).
The plain weight is the source of truth for loading; once a whole model is packed,
`pack_linear_weights` releases each plain weight no other module shares (the packed copy is
all the forward pass reads), so the weights are held once, not twice.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers import cpu_kernels
from kvflow.layers.memory import empty_on_huge_pages, return_freed_heap
from kvflow.quantization import kernels as quant_kernels
from kvflow.quantization import tiles as tile_kernels
from kvflow.quantization.qweight import QuantizedWeight


class Linear(nn.Linear):
    """`nn.Linear` that runs on its packed weight once `pack()` has made one."""

    packed_weight: torch.Tensor | None = None
    packed_bias: torch.Tensor | None = None  # the bias in the packed GEMM's dtype (kvflow)
    packing: str = "plain"  # "kvflow" | "onednn" | "plain" | "quantized" | "quantized-tiles"
    quant_weight: QuantizedWeight | None = None  # after tile packing: its record, tensors released
    quant_tiles: tile_kernels.QuantTiles | None = None
    _gemm_widened = None  # bf16 kvflow packing on AVX512-BF16: the GEMM with float32 output (forward_float32)

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Run on `weight` from now on; the plain weight is released (a tied one is untied:
        the module that shared it keeps it)."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight of shape {weight.shape} for a Linear of "
                             f"{(self.out_features, self.in_features)}")
        self.quant_weight, self.packing, self.quant_tiles = weight, "quantized", None
        self.packed_weight = self.packed_bias = self._gemm_widened = None
        self._quant_op = self._quant_logits_op = None  # bound on first use, once the bias has its final dtype
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta"),
                                   requires_grad=False)

    def kvflow_packed_shape(self) -> tuple[int, ...] | None:
        """The shape `pack()` will give this weight in kvflow's GEMM layout, or None when it
        will take another packing (or none)."""
        weight = self.weight
        if weight.device.type != "cpu" or os.environ.get("KVFLOW_PACKED_LINEAR", "1") == "0":
            return None
        kernels = cpu_kernels.load()
        if kernels is None or not kernels.has_gemm(weight.dtype):
            return None
        try:
            return kernels.packed_weight_shape(weight.dtype, *weight.shape)
        except ValueError:  # a layout the GEMM has no packing for (bf16 with an odd K)
            return None

    def quant_tiles_bytes(self) -> int | None:
        """The bytes `pack()` will fill with this quantized weight's tiles, or None when it will
        not take them."""
        return tile_kernels.packed_bytes(self.quant_weight) if self._takes_tiles() else None

    def pack(self, out: torch.Tensor | None = None) -> None:
        """Pack the weight for the fastest GEMM this machine has; kvflow's layout goes into
        `out` when given (a contiguous tensor of `kvflow_packed_shape()`, or for a quantized
        weight of `quant_tiles_bytes()` bytes)."""
        if self.quant_weight is not None:
            self._pack_quantized(out)
            return
        if self.weight.device.type == "meta":
            return  # packed already, and the plain weight released
        self.packed_weight, self.packed_bias, self.packing = None, None, "plain"
        self._gemm_widened = None  # (a repacking must not keep the old packed tensor alive through it)
        weight = self.weight.detach()
        if os.environ.get("KVFLOW_PACKED_LINEAR", "1") == "0" or weight.device.type != "cpu":
            return
        if self.kvflow_packed_shape() is not None:
            kernels = cpu_kernels.load()
            self.packed_weight, self.packing = kernels.pack_weight(weight, out), "kvflow"
            if self.bias is not None:
                self.packed_bias = self.bias.detach().to(weight.dtype).contiguous()
            # Everything but x is fixed from here on: bind it once, so a call costs one ctypes hop.
            self._gemm = functools.partial(kernels.gemm_prevalidated, packed=self.packed_weight,
                                           n=self.out_features, bias=self.packed_bias)
            self._gemm_widened = None if weight.dtype != torch.bfloat16 or not kernels.avx512_bf16 else \
                functools.partial(kernels.gemm_bf16_widened, packed=self.packed_weight, n=self.out_features,
                                  bias=self.packed_bias)
            return
        onednn_ok = torch.backends.mkldnn.is_available() and (
            weight.dtype == torch.float32
            or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        )
        if onednn_ok:
            try:
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                self.packing = "onednn"
            except RuntimeError:
                pass

    def _takes_tiles(self) -> bool:
        """bf16 models where the tiles run, a quantized weight not yet in them."""
        qw = self.quant_weight
        return (qw is not None and self.quant_tiles is None and self.weight.dtype == torch.bfloat16
                and qw.qweight.device.type == "cpu" and tile_kernels.available() and tile_kernels.supports(qw)
                and os.environ.get("KVFLOW_PACKED_LINEAR", "1") != "0")

    def _pack_quantized(self, out: torch.Tensor | None = None) -> None:
        """The quantized weight in tiles where they run (its row layout released)."""
        if not self._takes_tiles():
            return
        qw = self.quant_weight
        self.quant_tiles, self.packing = tile_kernels.pack(qw, out=out), "quantized-tiles"
        self.quant_weight = qw.released()
        self._quant_op = self._quant_logits_op = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_tiles is not None:
            if self._quant_op is None:
                self._quant_op = tile_kernels.prepare(self.quant_tiles, self.bias)
            return self._quant_op(x)
        if self.quant_weight is not None:
            if self._quant_op is None:
                self._quant_op = quant_kernels.prepare(self.quant_weight, self.bias)
            return self._quant_op(x)
        if self.packing == "kvflow" and x.dtype == self.packed_weight.dtype:
            if x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == self.in_features:
                return self._gemm(x)
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return cpu_kernels.load().gemm(rows, self.packed_weight, self.out_features, self.packed_bias).view(
                *x.shape[:-1], -1)
        if self.packing == "onednn" and x.dtype == self.weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        if self.weight.device.type == "meta":
            raise TypeError(f"this Linear runs on its {self.weight.dtype} packed weight ({self.packing}) and got "
                            f"{x.dtype} input; its plain weight was released after packing")
        return F.linear(x, self.weight, self.bias)


    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """The output in float32 (the LM head's logits). A quantized layer returns its float32
        accumulator as is: rounding logits to bf16 first makes ties of tokens whose logits
        differ by less than a bf16 step, and greedy then picks by token id."""
        if self.quant_weight is None:
            if (self.packing == "kvflow" and self._gemm_widened is not None and x.dtype == torch.bfloat16
                    and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == self.in_features):
                y = self._gemm_widened(x)  # the same values, widened as they are stored: no second pass
                if y is not None:
                    return y
            return self(x).float()
        if self._quant_logits_op is None:
            self._quant_logits_op = (
                tile_kernels.prepare(self.quant_tiles, self.bias, float32_out=True) if self.quant_tiles is not None
                else quant_kernels.prepare(self.quant_weight, self.bias, float32_out=True))
        return self._quant_logits_op(x)

    def release_plain_weight(self) -> None:
        """Keep only the packed weight (shape and dtype stay visible on a meta tensor)."""
        if self.packing == "plain":
            raise RuntimeError("release_plain_weight: this Linear has no packed weight to run on")
        self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)


def pack_linear_weights(model: nn.Module) -> dict[str, int]:
    """Pack every `Linear` of a loaded model and release the plain weights that nothing else
    uses (a tied LM head's weight is the embedding table, which stays here; `load_model` then
    lets the lookup read the packed head, `layers/embedding.py`); returns how many Linears took
    each packing.

    Weights in kvflow's layout are packed into one buffer per dtype on 2 MiB pages, and so are
    quantized weights' tiles: a decode step streams all of them, and on 4 KiB pages the GEMMs
    measured 2-14 % slower at 1-32 rows (the most at 1 row; int4 tiles at one row 10 %)."""
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    slots = _packed_weight_slots(linears)
    counts: dict[str, int] = {}
    for module in linears:
        quantized = module.quant_weight is not None
        module.pack(slots.get(id(module)))
        if module.packing != "plain" and id(module.weight) not in shared and module.weight.device.type != "meta":
            module.release_plain_weight()
            if slots:
                # The plain weight was heap memory its packed copy does not reuse: hand it back
                # now, or RSS peaks at both copies (about +170 MB for SmolLM2 in bf16).
                return_freed_heap()
        elif quantized and id(module) in slots:
            return_freed_heap()  # the row layout just released, likewise
        counts[module.packing] = counts.get(module.packing, 0) + 1
    return counts


def _packed_weight_slots(linears: list[Linear]) -> dict[int, torch.Tensor]:
    """id(Linear) -> its view of a shared huge-page buffer, for those not yet packed that will
    take kvflow's layout (one buffer per dtype) or quantized tiles (one uint8 buffer). Every
    slot starts 64-byte aligned (packed sizes are whole 64-byte rows), as the kernels' loads
    prefer."""
    plans: dict[torch.dtype, list[tuple[Linear, tuple[int, ...]]]] = {}
    for module in linears:
        if module.quant_weight is not None:
            nbytes = module.quant_tiles_bytes()
            if nbytes is not None:
                plans.setdefault(torch.uint8, []).append((module, (nbytes,)))
            continue
        shape = module.kvflow_packed_shape() if module.weight.device.type != "meta" else None
        if shape is not None:
            plans.setdefault(module.weight.dtype, []).append((module, shape))
    slots: dict[int, torch.Tensor] = {}
    for dtype, plan in plans.items():
        buffer = empty_on_huge_pages(sum(math.prod(shape) for _, shape in plan), dtype)
        offset = 0
        for module, shape in plan:
            size = math.prod(shape)
            slots[id(module)] = buffer[offset: offset + size].view(shape)
            offset += size
    return slots
