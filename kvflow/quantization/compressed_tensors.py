"""Hugging Face checkpoints in the compressed-tensors format (llm-compressor's W4A16 / W8A16),
run on their own integer weights.

Such a checkpoint has no float weights to fall back on: `config.json` carries a
`quantization_config` with `quant_method: "compressed-tensors"`, and every quantized linear
ships `weight_packed` (int32 words, pack-quantized) or an int8 `weight` (naive-/int-quantized),
a `weight_scale` [N, K / group] (or [N, 1] per channel), and, when asymmetric, a
`weight_zero_point`. The library's own dequantization is

    w = (q - zero_point) * scale        q, zero_point signed: [-8, 7] (4-bit), [-128, 127] (8-bit)

kvflow's `QuantizedWeight` is q * scale + offset with 4-bit values unsigned, so 4-bit q is
shifted by +8 and offset = -(zero_point + 8) * scale; 8-bit keeps its signed q and the offset
is -zero_point * scale (None when symmetric). With fp16/bf16 scales (what producers write)
both products are exact in float32 and so is their sum: the weights are exactly the
library's dequantization computed in float32. With float32 scales each step may round once,
so an element may differ from the library's single rounding by about one float32 ulp of
16 * scale (4-bit) or 256 * scale (8-bit asymmetric); symmetric 8-bit is q * scale, exact.

Only what the kernel runs is accepted; anything else is refused at start-up, naming the
setting and the values supported, rather than loading weights that would be wrong.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import torch

from kvflow.quantization.methods import pack_int4
from kvflow.quantization.qweight import INT4_BLOCK, QuantizedWeight

QUANT_METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
STRATEGIES = ("group", "channel")
NUM_BITS = (4, 8)
# the tensors a quantized linear ships besides (or instead of) `weight`
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weight quantization, as the kernel runs it."""

    num_bits: int
    strategy: str  # "group" | "channel"
    group_size: int | None  # None for "channel" (one group of all K inputs)
    symmetric: bool
    format: str
    targets: tuple[str, ...]

    @property
    def source(self) -> str:
        return f"{QUANT_METHOD}:W{self.num_bits}A16"


@dataclass(frozen=True)
class CompressedTensorsConfig:
    schemes: tuple[WeightScheme, ...]
    ignore: tuple[str, ...]

    @staticmethod
    def from_hf(qc: dict) -> CompressedTensorsConfig:
        """Parse `config.json`'s quantization_config; refuse every setting the kernel cannot run."""
        if qc.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"quantization_config.quant_method: {qc.get('quant_method')!r}; only "
                             f"{QUANT_METHOD!r} checkpoints are read as shipped")
        _refuse_if_set(qc, "sparsity_config", "sparsity (e.g. 2:4) is not supported; only dense weights are")
        _refuse_if_set(qc, "transform_config", "transforms (rotations) are not supported")
        _refuse_if_set(qc, "kv_cache_scheme", "KV cache quantization is not supported; the cache keeps dtype")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"quantization_config.quantization_status: {status!r} is not supported; "
                             "only 'compressed' checkpoints (integer weights on disk) are read")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise ValueError("quantization_config.config_groups is empty: nothing says how the weights are stored")
        top_format = qc.get("format")
        schemes = tuple(_parse_scheme(name, group, top_format) for name, group in groups.items())
        return CompressedTensorsConfig(schemes, tuple(qc.get("ignore") or ()))

    @property
    def num_bits(self) -> int:
        return min(s.num_bits for s in self.schemes)

    @property
    def group_size(self) -> int | None:
        sizes = [s.group_size for s in self.schemes if s.group_size]
        return min(sizes) if sizes else None

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme a linear module (HF name, e.g. model.layers.0.mlp.up_proj) is stored in,
        or None when it is ignored; targets and ignore entries are class names ("Linear"),
        exact module names, or "re:<regex>", matched as the library matches them."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for scheme in self.schemes:
            if any(_matches(target, module) for target in scheme.targets):
                return scheme
        return None


def _refuse_if_set(qc: dict, key: str, why: str) -> None:
    if qc.get(key):
        raise ValueError(f"quantization_config.{key}: {why} (got {qc[key]!r})")


def _parse_scheme(name: str, group: dict, top_format: str | None) -> WeightScheme:
    where = f"quantization_config.config_groups.{name}"
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise ValueError(f"{where}.{key}: activation quantization is not supported; only weight-only "
                             "schemes (W4A16, W8A16: input_activations null) are")
    fmt = group.get("format") or top_format
    if fmt not in FORMATS:
        raise ValueError(f"{where}.format: {fmt!r} is not supported; choose one of {', '.join(FORMATS)}")
    w = group.get("weights")
    if not w:
        raise ValueError(f"{where}.weights: missing; only weight quantization is supported")
    if w.get("type", "int") != "int":
        raise ValueError(f"{where}.weights.type: {w.get('type')!r} is not supported (e.g. float8); only 'int' is")
    bits = w.get("num_bits")
    if bits not in NUM_BITS:
        raise ValueError(f"{where}.weights.num_bits: {bits!r} is not supported; choose one of "
                         f"{', '.join(map(str, NUM_BITS))}")
    strategy = w.get("strategy")
    if strategy not in STRATEGIES:
        raise ValueError(f"{where}.weights.strategy: {strategy!r} is not supported; choose one of "
                         f"{', '.join(STRATEGIES)}")
    if w.get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic: {w['dynamic']!r} is not supported; weights must be static")
    if w.get("actorder") not in (None, False):
        raise ValueError(f"{where}.weights.actorder: {w['actorder']!r} (activation-ordered groups, g_idx) is "
                         "not supported; only actorder null")
    if w.get("block_structure"):
        raise ValueError(f"{where}.weights.block_structure: block quantization is not supported")
    group_size = None
    if strategy == "group":
        group_size = w.get("group_size")
        unit = INT4_BLOCK if bits == 4 else 8  # the kernel's 4-bit blocks / 8-bit lanes
        if not isinstance(group_size, int) or group_size <= 0 or group_size % unit:
            raise ValueError(f"{where}.weights.group_size: {group_size!r} is not supported for {bits}-bit; "
                             f"groups must be multiples of {unit} inputs (e.g. 32, 64, 128)")
    targets = tuple(group.get("targets") or ())
    if not targets:
        raise ValueError(f"{where}.targets: empty; nothing says which layers are quantized")
    return WeightScheme(bits, strategy, group_size, bool(w.get("symmetric", True)), fmt, targets)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    # a class name: every module the loader asks about is a linear layer
    return pattern in ("Linear", "torch.nn.Linear") or pattern == module


def required_parts(scheme: WeightScheme) -> tuple[str, ...]:
    """The tensor names (after the module prefix) one layer must ship before it is complete."""
    data = ("weight_packed", "weight_shape") if scheme.format == "pack-quantized" else ("weight",)
    return data + ("weight_scale",) + (() if scheme.symmetric else ("weight_zero_point",))


def to_quantized_weight(name: str, parts: dict[str, torch.Tensor], scheme: WeightScheme) -> QuantizedWeight:
    """One layer's stored tensors (keys as in `required_parts`) as a `QuantizedWeight`."""
    if "weight_g_idx" in parts:
        raise ValueError(f"{name}: ships weight_g_idx (activation-ordered groups), which is not supported")
    if scheme.format == "pack-quantized":
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        q = unpack_int32(parts["weight_packed"], scheme.num_bits, k)
    else:
        q = parts["weight"]
        if q.dtype != torch.int8:
            raise ValueError(f"{name}.weight: {scheme.format} weights must be int8, found {q.dtype}")
        n, k = q.shape
    if tuple(q.shape) != (n, k):
        raise ValueError(f"{name}: unpacked weight is {tuple(q.shape)}, weight_shape says {(n, k)}")
    scale = parts["weight_scale"].float()
    if scale.dim() == 1:
        scale = scale.unsqueeze(1)
    groups = scale.shape[1]
    group = k // groups
    expected = 1 if scheme.strategy == "channel" else k // (scheme.group_size or k)
    if scale.shape[0] != n or groups != expected or group * groups != k:
        raise ValueError(f"{name}.weight_scale: shape {tuple(scale.shape)} does not fit a {n}x{k} weight "
                         f"with strategy {scheme.strategy} (group_size {scheme.group_size})")
    unit = INT4_BLOCK if scheme.num_bits == 4 else 8
    if group % unit:
        raise ValueError(f"{name}: {scheme.strategy} groups of {group} inputs are not whole multiples of {unit}, "
                         f"which the {scheme.num_bits}-bit kernel needs")
    zero = torch.zeros(n, groups, dtype=torch.float32)
    if not scheme.symmetric:
        zp = parts["weight_zero_point"]
        if scheme.format == "pack-quantized":  # packed along the output dimension
            zp = unpack_int32(zp.t().contiguous(), scheme.num_bits, n).t()
        zero = zp.reshape(n, groups).float()
    if scheme.num_bits == 4:
        unsigned = (q.to(torch.int16) + 8).to(torch.uint8)  # [-8, 7] -> [0, 15]
        offsets = -(zero + 8.0) * scale
        return QuantizedWeight(pack_int4(unsigned.contiguous()), scale.contiguous(), offsets.contiguous(),
                               4, group, k, scheme.source)
    offsets = None if scheme.symmetric else (-zero * scale).contiguous()
    return QuantizedWeight(q.contiguous(), scale.contiguous(), offsets, 8, group, k, scheme.source)


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """int32 words [R, W] -> int8 [R, cols]: 32 / bits values a word, the first in the lowest
    bits, each stored + 2^(bits-1) (pack-quantized's layout for 4 and 8 bits)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"pack-quantized tensors are int32 words, found {packed.dtype}")
    data = packed.contiguous().view(torch.uint8)  # the words' bytes, lowest first on little-endian
    if sys.byteorder == "big":
        data = data.view(packed.shape[0], -1, 4).flip(-1)
    data = data.reshape(packed.shape[0], -1)
    if bits == 4:
        data = torch.stack((data & 0x0F, data >> 4), dim=-1).reshape(packed.shape[0], -1)
    values = data[:, :cols].to(torch.int16) - (1 << (bits - 1))
    return values.to(torch.int8)
