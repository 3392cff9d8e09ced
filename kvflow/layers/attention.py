"""Paged attention: the metadata a step carries and the backends that consume it.

A step is one flat batch of tokens from many sequences. The model runner orders it as
all decoding sequences first (exactly one query token each), then the prefill chunks
(one or more query tokens, possibly after earlier chunks already in the cache).
`AttentionMetadata` describes that batch in the same terms a GPU kernel wants
(cumulative query offsets, total sequence lengths, block tables, slot mapping), so a CUDA
backend can slot in beside the CPU one without the runner changing.

KV cache layout per layer: one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = K, 1 = V). Token `t` of a sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvflow.layers import cpu_kernels, kv_int8, kv_layout
from kvflow.layers.memory import empty_on_huge_pages


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    query_start_loc: list[int]  # [num_seqs + 1]: offsets of each sequence's queries in the flat batch
    seq_lens: list[int]  # [num_seqs]: context (already cached) + new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    num_decodes: int  # the first `num_decodes` sequences have exactly one query token
    block_size: int
    # The same offsets and lengths as int64 tensors, for the kernels; built from the lists when
    # not given (the runner passes views of the arrays it already has).
    query_start_tensor: torch.Tensor | None = None
    seq_lens_tensor: torch.Tensor | None = None
    # A bound on every decode length that fixes a GPU kernel's grid (a CUDA graph's replays
    # pass max_model_len and leave the host lists stale); None: max of the decodes' seq_lens.
    max_decode_seq_len: int | None = None

    def __post_init__(self) -> None:
        if self.query_start_tensor is None:
            self.query_start_tensor = torch.tensor(self.query_start_loc, dtype=torch.int64)
        if self.seq_lens_tensor is None:
            self.seq_lens_tensor = torch.tensor(self.seq_lens, dtype=torch.int64)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def to(self, device: torch.device) -> "AttentionMetadata":
        """The same step with its tensors on `device` (the host lists stay as they are)."""
        return dataclasses.replace(
            self, slot_mapping=self.slot_mapping.to(device, non_blocking=True),
            block_tables=self.block_tables.to(device, non_blocking=True),
            query_start_tensor=self.query_start_tensor.to(device, non_blocking=True),
            seq_lens_tensor=self.seq_lens_tensor.to(device, non_blocking=True))

    @property
    def decode_seq_lens(self) -> torch.Tensor:
        """[num_decodes] int64: the context length of each decoding sequence."""
        return self.seq_lens_tensor[: self.num_decodes]


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache and attends over each sequence's context."""

    name: str

    def allocate_kv_caches(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_dim: int, dtype: torch.dtype,
                           kv_cache_dtype: str = "auto") -> list[torch.Tensor] | list[kv_int8.Int8KVCache]:
        """Each layer's cache, [2, num_blocks, block_size, num_kv_heads, head_dim]: views into
        one pool allocated at once. With kv_cache_dtype="int8", `kv_int8.Int8KVCache`s (int8
        values and their scales, also views into one pool each).

        Zeroed, so the whole pool is resident from the start: the memory plan's figure is what
        the process holds, and resident memory does not creep up run after run as the prefix
        cache fills the pool. (No reader depends on the zeros: each looks only at slots below
        a sequence's length, or masks the rest, values included.)
        """
        if kv_int8.check_kv_cache_dtype(kv_cache_dtype) == "int8":
            return kv_int8.allocate(num_layers, num_blocks, block_size, num_kv_heads, head_dim, self._zeroed_pool)
        return list(self._zeroed_pool((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype))

    def _zeroed_pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


class CPUAttentionBackend(AttentionBackend):
    """Paged attention on the CPU.

    Decodes go through kvflow's compiled kernel (`cpu_kernels`), which reads K/V in place
    through the block table; without it they are batched into two PyTorch matmuls over
    gathered, padded blocks. Prefill chunks go through the compiled causal kernel, also
    reading the pool in place (first chunks and chunks over cached context alike).
    Otherwise a chunk with nothing cached yet attends over its own fresh K/V with SDPA
    (no gather), and a later chunk gathers its cached context.

    Keys are stored dimension-major within each block (`kv_layout`), for the decode kernel's
    q.k; every path here reads and writes them through that module.
    """

    name = "cpu"

    def __init__(self, use_kernels: bool = True) -> None:
        self.kernels = cpu_kernels.load() if use_kernels else None

    def _zeroed_pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """On 2 MiB pages where Linux gives them: a decode step reads blocks scattered over the
        pool, and with 4 KiB pages every block costs TLB misses (decode attention over a
        shuffled block table measured about 10% faster on huge pages)."""
        return empty_on_huge_pages(shape, dtype).zero_()

    def forward(self, q, k, v, kv_cache, meta, scale):
        if isinstance(kv_cache, kv_int8.Int8KVCache):
            return self._forward_int8(q, k, v, kv_cache, meta, scale)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if self.kernels is not None and k.dtype == key_cache.dtype and cpu_kernels.heads_contiguous(k) and cpu_kernels.heads_contiguous(v):
            self.kernels.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)  # 10x cheaper than index_copy_
        else:
            kv_layout.write_keys(key_cache, meta.slot_mapping, k)
            value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        return self._attend(q, k, v, key_cache, value_cache, meta, scale)

    def _forward_int8(self, q, k, v, cache: kv_int8.Int8KVCache, meta, scale):
        """The int8 cache: quantize the step's K/V into it, then attend over what it now holds
        (the chunk's own keys included, never the fresh float ones: see kv_int8)."""
        kv_int8.write(cache, k, v, meta.slot_mapping, self.kernels)
        if kv_int8.kernel_supports(self.kernels, q.shape[1], k.shape[1]):
            return kv_int8.paged_attention(self.kernels, q, cache, meta, scale)
        key_cache, value_cache, compact = kv_int8.gather_dequantized(cache, meta)
        out = _PYTORCH.forward_cached(q.float(), key_cache, value_cache, compact, scale)
        return out.to(q.dtype)

    def forward_cached(self, q, key_cache, value_cache, meta, scale):
        """Attention over K/V already in the cache (the chunk's own included)."""
        return self._attend(q, None, None, key_cache, value_cache, meta, scale)

    def _attend(self, q, k, v, key_cache, value_cache, meta, scale):
        """k/v: the step's fresh K/V, which a first chunk may attend over directly; None reads
        every key from the cache."""
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        nd = meta.num_decodes
        if nd == meta.num_seqs:  # a pure decode step: the kernel's output is the answer
            return self._decode(q, key_cache, value_cache, meta, scale)
        out = torch.empty(q.shape, dtype=q.dtype)
        if nd:
            out[:nd] = self._decode(q[:nd], key_cache, value_cache, meta, scale)
        kernels = self.kernels
        if (kernels is not None and cpu_kernels.heads_contiguous(q)
                and kernels.supports_prefill(q.dtype, q.shape[1], num_kv_heads, head_dim)):
            kernels.paged_prefill_attention(q, key_cache, value_cache, meta.block_tables[nd:],
                                            meta.query_start_tensor[nd:], meta.seq_lens_tensor[nd:], out, scale)
            return out
        for i in range(nd, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            context_len = meta.seq_lens[i] - (end - start)
            if context_len == 0 and k is not None:
                keys, values = k[start:end], v[start:end]
            else:
                num_blocks = -(-meta.seq_lens[i] // meta.block_size)
                table = meta.block_tables[i, :num_blocks]
                keys = kv_layout.keys_token_major(key_cache.index_select(0, table)).view(
                    -1, num_kv_heads, head_dim)[: meta.seq_lens[i]]
                values = value_cache.index_select(0, table).view(-1, num_kv_heads, head_dim)[: meta.seq_lens[i]]
            out[start:end] = _causal_attention(q[start:end], keys, values, context_len, scale)
        return out

    def _decode(self, q, key_cache, value_cache, meta, scale):
        kernels = self.kernels
        if kernels is not None and kernels.supports(q.dtype, q.shape[1], key_cache.shape[2], q.shape[2]):
            tables = meta.block_tables[: q.shape[0]]
            if not cpu_kernels.heads_contiguous(q):
                q = q.contiguous()
            return kernels.paged_decode_attention(q, key_cache, value_cache, tables, meta.decode_seq_lens, scale)
        return self._decode_torch(q, key_cache, value_cache, meta, scale)

    @staticmethod
    def _decode_torch(q, key_cache, value_cache, meta, scale):
        """One query per sequence against its blocks, as two batched matmuls.

        Written out rather than through SDPA: SDPA's masked CPU path is an order of magnitude
        slower in bf16 for this shape. Scores and softmax are float32; padding past each
        sequence's length (stale or never-written slots) is masked to -inf in the scores and
        to 0 in the values, since a NaN there would survive a zero weight (NaN * 0 is NaN).
        """
        nd, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[2]
        max_len = max(meta.seq_lens[:nd])
        num_blocks = -(-max_len // meta.block_size)
        tables = meta.block_tables[:nd, :num_blocks].reshape(-1)
        # index_select on whole blocks is several times faster than advanced indexing here;
        # heads-major contiguous K/V lets the batched matmuls run without strided fallbacks.
        keys = kv_layout.keys_token_major(key_cache.index_select(0, tables)).view(
            nd, -1, num_kv_heads, head_dim).transpose(1, 2).contiguous()
        values = value_cache.index_select(0, tables).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2).contiguous()
        group = num_heads // num_kv_heads
        qg = q.reshape(nd, num_kv_heads, group, head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [nd, KVH, group, L]
        padding = torch.arange(keys.shape[2]) >= meta.decode_seq_lens[:, None]
        scores.masked_fill_(padding.view(nd, 1, 1, -1), float("-inf"))
        values.masked_fill_(padding.view(nd, 1, -1, 1), 0)
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).view(nd, num_heads, head_dim)


# Above this many attention scores (heads x queries x keys) a chunk goes through SDPA's masked
# path instead of explicit float32 scores, to bound the temporary memory.
_MAX_EXPLICIT_SCORES = 1 << 24


def _causal_attention(q, keys, values, context_len: int, scale: float) -> torch.Tensor:
    """q: [n, H, D] at positions context_len..context_len+n-1; keys/values: [context_len+n, KVH, D]."""
    n, num_heads, head_dim = q.shape
    total, num_kv_heads = keys.shape[0], keys.shape[1]
    if context_len == 0:
        qh, kh, vh = q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
    future = torch.arange(total)[None, :] > (torch.arange(n)[:, None] + context_len)  # bottom-right causal
    if num_heads * n * total > _MAX_EXPLICIT_SCORES:
        qh, kh, vh = q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=~future, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
    # A later chunk over cached context, written out: SDPA's masked CPU path is slow in bf16.
    group = num_heads // num_kv_heads
    qg = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [KVH, G, n, D]
    kh = keys.transpose(0, 1).contiguous().unsqueeze(1)  # [KVH, 1, L, D]
    vh = values.transpose(0, 1).contiguous().unsqueeze(1)
    scores = torch.matmul(qg, kh.transpose(-1, -2)).float() * scale  # [KVH, G, n, L]
    scores.masked_fill_(future, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1).to(vh.dtype), vh)  # [KVH, G, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


# The int8 cache's fallback when the compiled kernels cannot take a shape (or are disabled).
_PYTORCH = CPUAttentionBackend(use_kernels=False)


def get_attn_backend(device: torch.device | str) -> AttentionBackend:
    """The backend for a device: the CPU's kernels, or on CUDA Triton's (imported only then)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPUAttentionBackend()
    if device.type == "cuda":
        from kvflow.layers.cuda_attention import CUDAAttentionBackend

        return CUDAAttentionBackend(device)
    raise ValueError(f"device: no attention backend for {device.type!r} (available: cpu, cuda)")


class Attention(torch.nn.Module):
    """The attention op of one layer: a thin module so models stay backend-agnostic."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend

    def forward(self, q, k, v, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, kv_cache, meta, self.scale)
