"""Paged decode attention: one query token per sequence against its blocks, split-K.

A decode step has few queries and long contexts, so parallelism over (sequence, KV head)
alone leaves most of a GPU idle when a batch is small. Each program takes one
(sequence, KV head, split): all query heads of the GQA group (padded to a tensor-core tile)
against one contiguous range of the sequence's keys, with an online softmax, and writes an
unnormalised partial (accumulator, running max, running sum). A second kernel merges the
splits of each (sequence, head). The grid depends only on the batch size and a bound on the
context length, never on the lengths themselves, so a CUDA graph can replay it with new
lengths; programs whose range lies past a sequence's length exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.layers.triton.common import dot as _dot, interpreted

# Keys per inner tile; the split length is a multiple of it.
DECODE_BLOCK_N = 32
# (The split count is a runtime argument, not a constexpr: capturing graphs for a dozen batch
# sizes then compiles each kernel once, not once per size.)
# Aim for about this many programs in the first kernel (an H200 has 132 SMs).
_TARGET_PROGRAMS = 512


@triton.jit
def _decode_split_kernel(q_ptr, key_cache, value_cache, block_tables, seq_lens, acc_ptr, ml_ptr, scale,
                         stride_qt, stride_qh, stride_bt, split_len, num_splits,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + seq).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask, d_mask = g < GROUP, d < HEAD_DIM
    head = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(block_tables + seq * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = (block * BLOCK_SIZE + n % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, DOT_F32) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, DOT_F32)
        m_i = m_new
    part = (seq * NUM_HEADS + head) * num_splits + split  # [BLOCK_G]
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(ml_ptr + part * 2, m_i, mask=g_mask)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_merge_kernel(acc_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, num_splits,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask, d_mask = s < num_splits, d < HEAD_DIM
    part = (seq * NUM_HEADS + head) * num_splits + s
    m = tl.load(ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(l > 0, tl.exp(m - m_max), 0.0)  # empty splits (past the length) weigh nothing
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    out = num / tl.where(den > 0, den, 1.0)  # a padded row (length 0) gives zeros, not NaN
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> tuple[int, int]:
    """(number of splits, keys per split) for a batch whose contexts are at most max_seq_len."""
    tiles = max(1, triton.cdiv(max_seq_len, DECODE_BLOCK_N))
    want = max(1, triton.cdiv(_TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads)))
    splits = min(want, tiles)
    split_len = triton.cdiv(tiles, splits) * DECODE_BLOCK_N
    return triton.cdiv(max(1, max_seq_len), split_len), split_len


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [S, H, D] (heads' dims contiguous); caches [num_blocks, block_size, KVH, D] token-major;
    block_tables [S, W]; seq_lens [S] (0: a padded row, output zeros). max_seq_len bounds every
    length and fixes the grid (pass max_model_len for a graph that replays with any length)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if q.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("paged_decode_attention: q's head dims and block table rows must be contiguous")
    group = num_heads // num_kv_heads
    num_splits, split_len = num_decode_splits(num_seqs, num_kv_heads, max_seq_len)
    acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 names the default; 16-bit ignores it
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, block_tables, seq_lens, acc, ml, scale,
        q.stride(0), q.stride(1), block_tables.stride(0), split_len, num_splits,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N, PRECISION=precision, DOT_F32=interpreted(), num_warps=4)
    _decode_merge_kernel[(num_seqs, num_heads)](
        acc, ml, out, out.stride(0), out.stride(1), num_splits, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d, num_warps=4)
    return out
