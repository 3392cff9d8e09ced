"""Hugging Face checkpoints in the GPTQ format (gptqmodel, AutoGPTQ, optimum), run on their own
integer weights.

`config.json` carries a `quantization_config` with `quant_method: "gptq"` and every quantized
linear ships four tensors (transposed against the float weight, K inputs, N outputs):

    qweight  int32 [K * bits / 32, N]   32 / bits values a word along K, the first in the lowest bits
    qzeros   int32 [groups, N * bits / 32]   zero points, packed the same way along N
    scales   float16 [groups, N]
    g_idx    int32 [K]                  the group of each input

and the producers' own dequantization (gptqmodel's `dequantize_weight`) is

    w[k, n] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])      q, zero unsigned: 0 .. 2^bits - 1

`checkpoint_format` "gptq" (v1, what every producer writes by default) stores each packed word of
zero points minus one per field (`qzeros - 0x11111111` for 4 bits, a whole-word subtraction, so a
zero point of 0 borrows from the next field); it is undone the same way, by adding the constant
to the word, as gptqmodel's own v1 -> v2 conversion does. "gptq_v2" stores the zero points as they are.

kvflow's `QuantizedWeight` is q * scale + offset: 4-bit q keeps its unsigned values and the offset
is -zero * scale; 8-bit q is stored signed (q - 128) with the offset (128 - zero) * scale. With
float16 or bfloat16 scales (what producers write) both products and their sum are exact in
float32, so the weights are bit for bit scale * (q - zero) evaluated exactly (and so equal to the
producer's own dequantization of the same tensors in float32). Float32 scales would let each of
the two steps round once: up to one float32 ulp of 2^bits * scale per element.

The kernel's groups are contiguous runs of inputs, so a `g_idx` that is not arange(K) // group_size
(`desc_act` / act-order, groups in activation order) is refused at load with the setting's name;
so is anything else the kernel cannot run (3-bit, groups that are not whole 32-input blocks,
other checkpoint formats, per-module overrides).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.quantization.methods import pack_int4
from kvflow.quantization.qweight import INT4_BLOCK, QuantizedWeight

QUANT_METHOD = "gptq"
BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
PARTS = ("qweight", "qzeros", "scales", "g_idx")  # what one quantized linear ships (a bias stays float)
_V1_ZERO_OFFSET = {4: 0x11111111, 8: 0x01010101}  # one per packed field of a 32-bit word


@dataclass(frozen=True)
class GPTQConfig:
    """A checkpoint's GPTQ settings, as the kernel runs them."""

    bits: int
    group_size: int | None  # None: one group of all inputs per output channel (group_size -1)
    sym: bool
    desc_act: bool
    checkpoint_format: str  # "gptq" (v1: zero points stored minus one) | "gptq_v2"
    lm_head: bool  # the LM head ships quantized too

    @property
    def source(self) -> str:
        return f"{QUANT_METHOD}:W{self.bits}A16"

    @staticmethod
    def from_hf(qc: dict) -> GPTQConfig:
        """Parse `config.json`'s quantization_config; refuse every setting the kernel cannot run."""
        if qc.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"quantization_config.quant_method: {qc.get('quant_method')!r}; only "
                             f"{QUANT_METHOD!r} checkpoints are read by the GPTQ loader")
        bits = qc.get("bits")
        if bits not in BITS or isinstance(bits, bool):
            raise ValueError(f"quantization_config.bits: {bits!r} is not supported; choose one of "
                             f"{', '.join(map(str, BITS))}")
        group_size = qc.get("group_size", -1)
        unit = INT4_BLOCK if bits == 4 else 8  # the kernel's 4-bit blocks / 8-bit lanes
        if group_size == -1:
            group_size = None
        elif not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0 or group_size % unit:
            raise ValueError(f"quantization_config.group_size: {group_size!r} is not supported for {bits}-bit; "
                             f"choose -1 (per channel) or a multiple of {unit} inputs (e.g. 32, 64, 128)")
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(f"quantization_config.checkpoint_format: {fmt!r} is not supported; choose one of "
                             f"{', '.join(CHECKPOINT_FORMATS)} (the packed qweight/qzeros layout)")
        pack_dtype = qc.get("pack_dtype", "int32")
        if pack_dtype not in ("int32", "torch.int32"):
            raise ValueError(f"quantization_config.pack_dtype: {pack_dtype!r} is not supported; only int32 words")
        if qc.get("dynamic"):
            raise ValueError("quantization_config.dynamic: per-module overrides of bits/group_size are not "
                             f"supported; one setting for every layer is (got {qc['dynamic']!r})")
        for key in ("sym", "desc_act", "lm_head"):
            if not isinstance(qc.get(key, False), bool):
                raise ValueError(f"quantization_config.{key}: {qc[key]!r} is not a boolean (true or false)")
        return GPTQConfig(bits, group_size, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)), fmt,
                          bool(qc.get("lm_head", False)))


def to_quantized_weight(name: str, parts: dict[str, torch.Tensor], config: GPTQConfig) -> QuantizedWeight:
    """One layer's stored tensors (qweight, qzeros, scales, g_idx) as a `QuantizedWeight`."""
    bits = config.bits
    per_word = 32 // bits
    qweight, qzeros, scales, g_idx = (parts[p] for p in PARTS)
    for part, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        if tensor.dtype != torch.int32 or tensor.dim() != 2:
            raise ValueError(f"{name}.{part}: GPTQ packs int32 words [rows, cols], found {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    groups = scales.shape[0] if scales.dim() == 2 else 0
    if scales.dim() != 2 or scales.shape[1] != n or groups == 0 or k % groups:
        raise ValueError(f"{name}.scales: shape {tuple(scales.shape)} does not fit a weight of {k} inputs and "
                         f"{n} outputs (expected [groups, {n}])")
    group = k // groups
    expected = config.group_size or k
    if group != expected:
        raise ValueError(f"{name}: ships groups of {group} inputs, quantization_config.group_size says "
                         f"{config.group_size or -1}")
    unit = INT4_BLOCK if bits == 4 else 8
    if group % unit:
        raise ValueError(f"{name}: groups of {group} inputs are not whole multiples of {unit}, which the "
                         f"{bits}-bit kernel needs")
    if tuple(qzeros.shape) != (groups, n // per_word) or n % per_word:
        raise ValueError(f"{name}.qzeros: shape {tuple(qzeros.shape)}, expected {(groups, n // per_word)}")
    if tuple(g_idx.shape) != (k,) or not torch.equal(g_idx.long(), torch.arange(k) // group):
        raise ValueError(f"{name}.g_idx: inputs are not in contiguous groups of {group} (desc_act / act-order "
                         f"checkpoint, quantization_config.desc_act={config.desc_act}); only desc_act false, or "
                         "a g_idx equal to arange(in_features) // group_size, is supported")
    if config.checkpoint_format == "gptq":  # v1: every field of every word was stored minus one
        qzeros = (qzeros.long() + _V1_ZERO_OFFSET[bits]) & 0xFFFFFFFF
    q = unpack_int32(qweight.t(), bits)  # [N, K]
    zero = unpack_int32(qzeros, bits).t().float()  # [N, groups]
    scale = scales.t().float().contiguous()  # [N, groups]
    if bits == 4:
        return QuantizedWeight(pack_int4(q.contiguous()), scale, (-zero * scale).contiguous(), 4, group, k,
                               config.source)
    signed = (q.to(torch.int16) - 128).to(torch.int8)
    return QuantizedWeight(signed.contiguous(), scale, ((128.0 - zero) * scale).contiguous(), 8, group, k,
                           config.source)


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Words [R, C] (int32, or int64 holding 32-bit values) -> uint8 [R, C * 32 / bits]: each word's
    fields along the last dimension, the lowest bits first (GPTQ's layout for qweight, transposed,
    and for qzeros)."""
    words = packed.long() & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `unpack_int32` (uint values [R, C] -> int32 words [R, C * bits / 32]), for tests
    and tools that write GPTQ tensors."""
    rows = values.shape[0]
    fields = values.long().reshape(rows, -1, 32 // bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (fields << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
