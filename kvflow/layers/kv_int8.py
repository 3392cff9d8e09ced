"""The int8 KV cache (`kv_cache_dtype="int8"`): half the bytes of bf16 per cached token.

Each token's K (and V) head is stored as int8 with one float16 scale beside the blocks:
x = q * scale, scale = max|x| / 127 (rounded to float16 before the quantization uses it,
so the stored pair is exactly what was meant). Per token and head rather than per block or
per channel because a token's K/V is written once, when it is computed, and never again: a
per-token scale needs no rescaling of earlier tokens and makes the stored bits independent
of what else shares the block. This is what keeps prefix caching, preemption and chunking
exact in this mode: a token's stored K/V depend only on that token's K/V.

With SmolLM2's head_dim of 64, a token costs 2 x (64 + 2) bytes per KV head and layer
instead of 2 x 128 in bf16: 1.94x the tokens in the same memory (3.9x against float32).

Attention always reads the cache, the chunk's own K/V included (never the fresh float K/V),
so a row's output does not depend on whether its context was computed in this step, an
earlier chunk or another request (prefix caching). The compiled kernel (csrc/kv_int8.cpp,
numerics in csrc/int8_attention.h) reads the int8 blocks in place: int8 widened to float32
in registers, the K scale applied to each score and the V scale to each probability, on
AVX-512 or through a portable path with the same bits. That agrees with float32 attention over
the dequantized values to float32 rounding; without the kernels those dequantized values go
through PyTorch.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, replace

import torch

from kvflow.layers import kv_layout
from kvflow.layers.cpu_kernels import DTYPE_CODES, check_rc, heads_contiguous

KV_CACHE_DTYPES = ("auto", "int8")  # "auto": the model's dtype
_SCALE_DTYPE = torch.float16
_FLOAT16_MAX = 65504.0


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """The option as given, or a ValueError naming the supported values."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not supported by the CPU backend; choose one of "
                         f"{', '.join(KV_CACHE_DTYPES)} (auto keeps the model's dtype)")
    return kv_cache_dtype


def bytes_per_element(kv_cache_dtype: str, head_dim: int, dtype: torch.dtype) -> float:
    """Bytes a cached K or V element costs, scales included."""
    if check_kv_cache_dtype(kv_cache_dtype) == "int8":
        return 1 + _SCALE_DTYPE.itemsize / head_dim
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class Int8KVCache:
    """One layer's int8 KV cache: views into one pool for all layers."""

    data: torch.Tensor  # int8 [2, num_blocks, block_size, num_kv_heads, head_dim]; keys in kv_layout's cells
    scales: torch.Tensor  # float16 [2, num_blocks, block_size, num_kv_heads]

    @property
    def num_blocks(self) -> int:
        return self.data.shape[1]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache as float32 key and value caches in the float layout (for tests and
        tools; attention dequantizes only the blocks it reads)."""
        keys = kv_layout.keys_token_major(self.data[0]).float() * self.scales[0].float()[..., None]
        values = self.data[1].float() * self.scales[1].float()[..., None]
        return kv_layout.key_cache_from_token_major(keys), values


def allocate(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
             zeroed_pool) -> list[Int8KVCache]:
    if head_dim % 4:
        raise ValueError(f"kv_cache_dtype: int8 stores keys in 4-byte cells of 4 dims; head_dim {head_dim} is not "
                         "a multiple of 4 (use kv_cache_dtype=auto)")
    data = zeroed_pool((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), torch.int8)
    scales = zeroed_pool((num_layers, 2, num_blocks, block_size, num_kv_heads), _SCALE_DTYPE)
    return [Int8KVCache(data[i], scales[i]) for i in range(num_layers)]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, heads, head_dim] -> (int8 values, float16 scale per token and head).

    The scale is rounded to float16 first and the values quantized against that rounded
    scale, so q * scale is within half a step of x (an all-zero head gets scale 0)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / 127).clamp_(max=_FLOAT16_MAX).to(_SCALE_DTYPE)
    s = scale.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round(x / torch.where(s > 0, s, 1)), 0).clamp_(-127, 127)
    return q.to(torch.int8), scale


def write(cache: Int8KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kernels) -> None:
    """Quantize the step's K/V [tokens, kv_heads, head_dim] into their slots: in one kernel
    call (csrc/kv_int8.cpp, the same bits as `quantize`), else through `quantize`."""
    tokens, num_kv_heads, head_dim = k.shape
    if (kernels is not None and k.dtype == v.dtype and k.dtype in DTYPE_CODES and heads_contiguous(k)
            and heads_contiguous(v) and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        check_rc(_entry_point(kernels.lib, "kvflow_write_kv_int8")(
            DTYPE_CODES[k.dtype], k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cache.data[0].data_ptr(),
            cache.scales[0].data_ptr(), cache.data[1].data_ptr(), cache.scales[1].data_ptr(), slot_mapping.data_ptr(),
            tokens, num_kv_heads, head_dim, cache.data.shape[2]), "write_kv_int8")
        return
    (qk, sk), (qv, sv) = quantize(k), quantize(v)
    key_cache, value_cache = cache.data[0], cache.data[1]
    kv_layout.write_keys(key_cache, slot_mapping, qk)
    value_cache.view(-1, *qv.shape[1:]).index_copy_(0, slot_mapping, qv)
    cache.scales[0].view(-1, num_kv_heads).index_copy_(0, slot_mapping, sk)
    cache.scales[1].view(-1, num_kv_heads).index_copy_(0, slot_mapping, sv)


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "kvflow_paged_attention_int8": [ctypes.c_int, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR,
                                    _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int],
    "kvflow_write_kv_int8": [ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64],
}


@functools.cache
def _entry_point(lib: ctypes.CDLL, name: str):
    fn = getattr(lib, name)
    fn.argtypes = _SIGNATURES[name]
    fn.restype = ctypes.c_int
    return fn


def paged_attention(kernels, q: torch.Tensor, cache: Int8KVCache, meta, scale: float,
                    portable: bool = False) -> torch.Tensor:
    """Every query row of the step against its sequence's cached keys (its own included),
    through the compiled kernel, which reads the int8 blocks in place (csrc/int8_attention.h).
    q [T, heads, head_dim] in any float dtype; the result is in q's dtype (computed in float32
    from q's exact float32 value, so a bf16 q gives the float32 run's rows rounded to bf16).
    `portable` forces the portable implementation (tests check it gives the same bits)."""
    qk = q if q.dtype in DTYPE_CODES and heads_contiguous(q) else q.float().contiguous()
    out = torch.empty(qk.shape, dtype=qk.dtype)
    _, num_blocks, block_size, num_kv_heads, head_dim = cache.data.shape
    tables = meta.block_tables.contiguous()
    rc = _entry_point(kernels.lib, "kvflow_paged_attention_int8")(
        DTYPE_CODES[qk.dtype], qk.data_ptr(), qk.stride(0), cache.data[0].data_ptr(), cache.scales[0].data_ptr(),
        cache.data[1].data_ptr(), cache.scales[1].data_ptr(), tables.data_ptr(), tables.stride(0),
        meta.query_start_tensor.data_ptr(), meta.seq_lens_tensor.data_ptr(), out.data_ptr(), out.stride(0),
        meta.num_seqs, q.shape[1], num_kv_heads, head_dim, block_size, scale, int(portable))
    if rc != 0:
        raise ValueError(f"int8 paged attention: unsupported shape (heads {q.shape[1]}, kv heads {num_kv_heads}, "
                         f"head_dim {head_dim})")
    return out if out.dtype == q.dtype else out.to(q.dtype)


def kernel_supports(kernels, num_heads: int, num_kv_heads: int) -> bool:
    return kernels is not None and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= kernels.max_group


def gather_dequantized(cache: Int8KVCache, meta):
    """The blocks this step reads, dequantized into a compact float32 cache, and the metadata
    with its block tables renumbered into it: the PyTorch path's input."""
    ids = torch.unique(meta.block_tables)
    keys = kv_layout.keys_token_major(cache.data[0].index_select(0, ids)).float()
    keys = kv_layout.key_cache_from_token_major(keys * cache.scales[0].index_select(0, ids).float()[..., None])
    values = cache.data[1].index_select(0, ids).float() * cache.scales[1].index_select(0, ids).float()[..., None]
    return keys, values, replace(meta, block_tables=torch.searchsorted(ids, meta.block_tables))
