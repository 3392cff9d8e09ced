"""GGUF files (llama.cpp's format): a Hugging Face style config, HF-named fp32 weights, a tokenizer.

Why a hand-rolled header parser instead of `gguf.GGUFReader`: the reader eagerly turns every
metadata value into numpy views, and a GGUF carries its whole vocabulary and merge table as
metadata (~100k strings for SmolLM2), which costs ~2 s per open on a small CPU. Start-up time
matters to a server, so we walk the header with `struct` (~50 ms), skipping string arrays we do
not need. For the same reason the block types kvflow runs as shipped dequantize through their
`QuantizedWeight` (bit for bit `gguf.quants.dequantize`, several times faster), and the others
through gguf itself.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvflow.loader.gguf_experts import BLOCK_NAMES as EXPERT_BLOCK_NAMES
from kvflow.loader.gguf_experts import expert_parts, moe_config
from kvflow.quantization.gguf import SHIPPED_NAMES, SHIPPED_TYPES, from_gguf_blocks
from kvflow.quantization.qweight import QuantizedWeight

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 used 32-bit counts; llama.cpp has not written it since 2023
_DEFAULT_ALIGNMENT = 32
# metadata value type id -> struct format of a scalar (8 = string and 9 = array are handled apart)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    **EXPERT_BLOCK_NAMES,  # routers and shared experts; stacked experts: gguf_experts.expert_parts
}  # fmt: skip
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors with no Hugging Face parameter. rope_freqs holds llama3-style per-frequency rope
# factors that HF recomputes from config.rope_scaling, which the GGUF does not carry.
_SKIPPED = {"rope_freqs.weight"}


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: [out_features, in_features]
    qtype: int
    offset: int  # absolute offset of the first byte in the file
    nbytes: int


@dataclass(frozen=True)
class _Header:
    metadata: dict[str, Any]  # string arrays other than the requested ones hold only their length
    tensors: tuple[_TensorInfo, ...]


class _Cursor:
    """Sequential little-endian reads over the mapped file; any overrun means a corrupt file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.take("Q")
        end = self.pos + length
        if end > len(self.buf):
            raise struct.error("string runs past the end of the file")
        text = self.buf[self.pos : end].decode("utf-8")
        self.pos = end
        return text

    def value(self, vtype: int, keep_strings: bool) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.take(_SCALAR_FORMATS[vtype])[0]
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise struct.error(f"unknown metadata value type {vtype}")
        etype, count = self.take("IQ")
        if etype in _SCALAR_FORMATS:
            if self.pos + count * struct.calcsize(_SCALAR_FORMATS[etype]) > len(self.buf):
                raise struct.error("array runs past the end of the file")
            return list(self.take(f"{count}{_SCALAR_FORMATS[etype]}"))
        if etype != _STRING:
            raise struct.error(f"unsupported metadata array element type {etype}")
        if keep_strings:
            return [self.string() for _ in range(count)]
        for _ in range(count):  # length-prefixed, so walking is the only way past it
            (length,) = self.take("Q")
            self.pos += length
        return count


def _corrupt(path: str, why: object) -> ValueError:
    return ValueError(f"model: {path} is corrupt or not a GGUF file ({why})")


def _parse_header(path: str, keep_string_arrays: tuple[str, ...] = ()) -> _Header:
    """Metadata and the tensor table, without touching tensor data."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise _corrupt(path, f"only {size} bytes")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse_mapped(_Cursor(buf), path, size, keep_string_arrays)
    except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise _corrupt(path, e) from e


def _parse_mapped(cur: _Cursor, path: str, size: int, keep: tuple[str, ...]) -> _Header:
    if cur.buf[:4] != _MAGIC:
        raise _corrupt(path, f"magic bytes {cur.buf[:4]!r}, expected {_MAGIC!r}")
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("IQQ")
    if version not in _VERSIONS:
        raise _corrupt(path, f"GGUF version {version}; only versions {_VERSIONS} are read")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        (vtype,) = cur.take("I")
        metadata[key] = cur.value(vtype, key in keep)
    entries = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.take("I")
        dims = cur.take(f"{n_dims}Q")
        qtype, offset = cur.take("IQ")
        entries.append((name, tuple(reversed(dims)), qtype, offset))  # ggml lists the fastest dim first
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, qtype, offset in entries:
        if qtype not in GGML_QUANT_SIZES:
            raise ValueError(f"model: {path}: tensor {name!r} has unknown ggml type id {qtype}")
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        elements = int(np.prod(shape, dtype=np.int64))
        info = _TensorInfo(name, shape, qtype, data_start + offset, elements // block * type_bytes)
        if info.offset + info.nbytes > size:
            raise _corrupt(path, f"tensor {name!r} runs past the end of the file (truncated?)")
        tensors.append(info)
    return _Header(metadata, tuple(tensors))


@functools.lru_cache(maxsize=4)
def _cached_header(path: str, size: int, mtime_ns: int) -> _Header:
    return _parse_header(path)


def _header(path: str) -> _Header:
    """Config and weights both need the header; parse it once per (unchanged) file."""
    if not os.path.isfile(path):
        raise ValueError(f"model: {path} does not exist or is not a file")
    st = os.stat(path)
    return _cached_header(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def _architecture(header: _Header, path: str) -> str:
    arch = header.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model: {path} has GGUF architecture {arch!r}; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def gguf_architecture(path: str) -> str:
    """The file's llama.cpp architecture name; ValueError naming the supported ones."""
    return _architecture(_header(path), path)


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The file's key/value metadata (string arrays such as the vocabulary hold only their length)."""
    return dict(_header(path).metadata)


def read_gguf_config(path: str) -> dict:
    """A Hugging Face config.json-style dict, so `ModelConfig.from_hf_config` serves both formats."""
    header = _header(path)
    arch = _architecture(header, path)
    meta = header.metadata

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    try:
        hidden, heads, kv_heads = int(get("embedding_length")), *_head_counts(meta, arch)
        layers, ffn = int(get("block_count")), int(get("feed_forward_length") or get("expert_feed_forward_length"))
    except (TypeError, KeyError) as e:  # a required key is missing
        raise _corrupt(path, f"missing {arch}.* shape metadata") from e
    shapes = {t.name: t.shape for t in header.tensors}
    vocab = get("vocab_size")
    if vocab is None:
        vocab = shapes["token_embd.weight"][0] if "token_embd.weight" in shapes else meta.get("tokenizer.ggml.tokens")
    eos: Any = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")  # chat end-of-turn, when it differs from EOS
    if eot is not None and eos is not None and eot != eos:
        eos = [eos, eot]
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab) if vocab is not None else None,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(get),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "qkv_bias": "blk.0.attn_q.bias" in shapes,  # Qwen2-MoE's name for it
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "torch_dtype": None,  # quantized blocks: the caller picks the compute dtype
    }
    if get("expert_count"):  # a mixture of experts (Mixtral's file says "llama")
        config |= moe_config(get, arch, shapes, layers, ffn)
    if "rope_freqs.weight" in shapes:
        logger.warning("%s: rope_freqs (llama3 rope scaling factors) is ignored; rope_scaling is not set", path)
    return config


def _head_counts(meta: dict[str, Any], arch: str) -> tuple[int, int]:
    """(query heads, kv heads); some converters store kv heads per layer as an array."""
    heads = int(meta[f"{arch}.attention.head_count"])
    kv = meta.get(f"{arch}.attention.head_count_kv", heads)
    return heads, int(max(kv) if isinstance(kv, list) else kv)


def _rope_scaling(get: Any) -> dict | None:
    """Linear/YaRN context extension as HF spells it; None when the file declares none."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(get("rope.scaling.factor", 1.0))}
    original = get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (interleaved rotary pairs back to HF's half split).

    llama.cpp wrote `w.reshape(n_head, 2, r // n_head // 2, *rest).swapaxes(1, 2)`; swapping the
    same two axes of the mirrored shape restores the original row order exactly.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(data: np.ndarray, info: _TensorInfo, path: str) -> np.ndarray:
    """The tensor as float32. The block types kvflow runs as shipped go through their
    `QuantizedWeight` (torch, whole tensors at once: bit for bit gguf's values, which
    tests/quantization checks per type); gguf's numpy reader, row group by row group, took
    2.2 of the 3.6 seconds of building the default model's engine."""
    raw = data[info.offset : info.offset + info.nbytes]
    if info.qtype in SHIPPED_TYPES and len(info.shape) == 2:
        return from_gguf_blocks(raw, info.qtype, info.shape).dequantize().numpy()
    try:
        qtype = GGMLQuantizationType(info.qtype)
        block, type_bytes = GGML_QUANT_SIZES[qtype]
        raw = raw.reshape(*info.shape[:-1], info.shape[-1] // block * type_bytes)
        out = dequantize(raw, qtype)
    except NotImplementedError as e:
        raise ValueError(
            f"model: {path}: tensor {info.name!r} is stored as {GGMLQuantizationType(info.qtype).name}, "
            "which gguf cannot dequantize"
        ) from e
    return out.reshape(info.shape)


def iter_gguf_weights(
    path: str, keep_quantized: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield (HF parameter name, weight) one tensor at a time, so peak memory is one tensor.

    Weights are fp32 CPU tensors, except that a tensor whose HF name `keep_quantized` accepts
    and which the file stores in a type kvflow runs (SHIPPED_TYPES: Q8_0, Q4_0, Q4_1 and the
    K-quants) comes as a `QuantizedWeight` of its own blocks (quantization/gguf.py); with
    `keep_quantized` given, so does an embedding table stored in those types (the model
    dequantizes it into its table), and where the head is tied to it and `keep_quantized`
    accepts "lm_head.weight", the head as the same blocks. Other quantized types are
    dequantized, with a log line."""
    header = _header(path)
    arch = _architecture(header, path)
    heads, kv_heads = _head_counts(header.metadata, arch)
    # a plain ndarray view: gguf's row-group slicing is several times slower on np.memmap subclasses
    data = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    dequantized: dict[str, int] = {}
    tied_head = not any(t.name == "output.weight" for t in header.tensors)
    for hf_name, info in _named_tensors(header, path):
        n_head = heads if ".attn_q." in info.name else kv_heads if ".attn_k." in info.name else None
        permuted = arch == "llama" and n_head is not None
        if keep_quantized is not None and keep_quantized(hf_name):
            if info.qtype in SHIPPED_TYPES and len(info.shape) == 2:
                raw = data[info.offset : info.offset + info.nbytes]
                weight = from_gguf_blocks(raw, info.qtype, info.shape)
                if permuted:
                    order = _unpermute_rows(np.arange(info.shape[0]), n_head)
                    weight = weight.select_rows(torch.from_numpy(order))
                yield hf_name, weight
                continue
            if info.qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
                kind = GGMLQuantizationType(info.qtype).name
                dequantized[kind] = dequantized.get(kind, 0) + 1
        if (hf_name == "model.embed_tokens.weight" and keep_quantized is not None and info.qtype in SHIPPED_TYPES
                and len(info.shape) == 2):
            # The lookup's table comes as its blocks, which the model dequantizes a few thousand
            # rows at a time into its own dtype: no float32 copy of the whole table (a 128k x 2k
            # vocabulary's is 1 GB). A tied LM head multiplies by the same blocks, as shipped.
            blocks = from_gguf_blocks(data[info.offset : info.offset + info.nbytes], info.qtype, info.shape)
            if tied_head and keep_quantized("lm_head.weight"):
                yield "lm_head.weight", blocks
            yield hf_name, blocks
            continue
        w = _dequantize(data, info, path)
        if permuted:
            w = _unpermute_rows(w, n_head)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if not w.flags.writeable:  # F32 tensors come back as views of the read-only map: own a copy
            w = w.copy()
        yield hf_name, torch.from_numpy(w)
    for kind, count in dequantized.items():
        logger.warning("%s: %d weights stored as %s have no kvflow kernel; they were dequantized to run "
                       "unquantized (kernels run %s as shipped)", path, count, kind,
                       ", ".join(SHIPPED_NAMES))


def _named_tensors(header: _Header, path: str) -> Iterator[tuple[str, _TensorInfo]]:
    """(HF name, tensor) of every weight the model takes: a stacked expert tensor as one 2-D
    tensor per expert (a run of its bytes), a 1-D shared-expert gate as the [1, hidden] row it is."""
    for info in header.tensors:
        if info.name in _SKIPPED:
            continue
        parts = expert_parts(info.name, info.shape, info.nbytes)
        if parts is not None:
            for hf_name, shape, offset in parts:
                yield hf_name, dataclasses.replace(info, shape=shape, offset=info.offset + offset,
                                                   nbytes=info.nbytes // len(parts))
            continue
        hf_name = _hf_name(info.name)
        if hf_name is None:
            raise ValueError(f"model: {path}: GGUF tensor {info.name!r} has no Hugging Face counterpart")
        if len(info.shape) == 1 and hf_name.endswith("shared_expert_gate.weight"):
            info = dataclasses.replace(info, shape=(1, info.shape[0]))
        yield hf_name, info


def linear_weight_types(path: str) -> dict[str, int]:
    """How many 2-D weights (other than the embedding) the file stores in each type, e.g. {"Q4_1": 210}."""
    counts: dict[str, int] = {}
    for info in _header(path).tensors:
        if len(info.shape) >= 2 and info.name != "token_embd.weight":
            kind = GGMLQuantizationType(info.qtype).name
            counts[kind] = counts.get(kind, 0) + (info.shape[0] if len(info.shape) == 3 else 1)  # 3-D: an expert each
    return counts
