"""Paged prefill attention: causal, tiled (FlashAttention-style), reading K/V through the block table.

One kernel serves first chunks and chunks over cached context: a chunk of q_len queries at
positions ctx..ctx+q_len-1 (ctx = seq_len - q_len keys already cached) attends to keys
0..ctx+i. The chunk's own K/V is read back from the pool (the KV store runs first), so a row's
result does not depend on how its prompt was chunked. Each program takes BLOCK_M queries of one
head and walks the key tiles up to the last one its rows can see, with an online softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.layers.triton.common import dot as _dot, interpreted


@triton.jit
def _prefill_kernel(q_ptr, key_cache, value_cache, block_tables, query_start, seq_lens, out_ptr, scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    seq, head, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start + seq).to(tl.int32)
    q_len = tl.load(query_start + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens + seq).to(tl.int32)
    if m_block * BLOCK_M < q_len:
        ctx = seq_len - q_len
        kv_head = head // GROUP
        qi = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        q_mask, d_mask = qi < q_len, d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=q_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = tl.minimum(seq_len, ctx + (m_block + 1) * BLOCK_M)  # the last key these rows see, + 1
        for n0 in range(0, kv_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < kv_end
            block = tl.load(block_tables + seq * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            rows = (block * BLOCK_SIZE + n % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(key_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), PRECISION, DOT_F32) * scale  # [BLOCK_M, BLOCK_N]
            visible = n_mask[None, :] & (n[None, :] <= (ctx + qi)[:, None])  # key 0 is visible to every row
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(value_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, DOT_F32)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + (q_start + qi)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                            out: torch.Tensor, scale: float, max_query_len: int,
                            block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Attention of S chunks. q/out: [T, H, D] flat batch (rows query_start[i]..query_start[i+1]
    are chunk i; others are left alone); caches token-major [num_blocks, block_size, KVH, D];
    block_tables [S, W]; seq_lens [S]: cached context + the chunk."""
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_seqs == 0 or max_query_len == 0:
        return out
    if q.stride(2) != 1 or out.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("paged_prefill_attention: head dims and block table rows must be contiguous")
    fp32 = q.dtype == torch.float32
    block_m = block_m or (32 if fp32 else 64)
    block_n = block_n or (32 if fp32 else 64)
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, key_cache, value_cache, block_tables, query_start, seq_lens, out, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if fp32 else "tf32", DOT_F32=interpreted(), num_warps=4, num_stages=2)
    return out
