"""kvflow's Triton attention kernels against a float64 reference, on small shapes: paged layout
(shuffled block tables), several block sizes, ragged lengths, GQA ratios, chunks over cached
context. Without a GPU they run under Triton's interpreter (slow per element: shapes stay tiny)."""

from __future__ import annotations

import pytest
import torch

from tests.layers.triton.interpreter import DEVICE, load_kernels

kernels = load_kernels()


def _paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen, spare_blocks=3):
    """Random token-major K/V for each sequence, scattered over a pool through shuffled tables;
    unused slots hold NaN, so a kernel that reads past a length fails."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    tables = torch.zeros((len(seq_lens), max(blocks_per_seq)), dtype=torch.int64)
    keys, values, used = [], [], 0
    for i, n in enumerate(seq_lens):
        table = order[used: used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        tables[i, : len(table)] = table
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = table[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        keys.append(k)
        values.append(v)
    return key_cache, value_cache, tables, keys, values


def _reference(q, k, v, context_len, scale):
    """q: [n, H, D] at positions context_len.., k/v: [context_len + n, KVH, D]; float64, causal."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    future = torch.arange(k.shape[0])[None, :] > (torch.arange(n)[:, None] + context_len)
    scores.masked_fill_(future, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def _to(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,seq_lens", [
    (16, 4, 4, [1, 17, 40]),      # MHA, a one-token context, lengths across block boundaries
    (8, 6, 2, [5, 70, 33, 64]),   # GQA 3 (a group padded to the tile), several splits per sequence
    (32, 8, 1, [100, 3]),         # MQA, one sequence much longer than the other
])
def test_decode_matches_reference(block_size, num_heads, num_kv_heads, seq_lens):
    gen = torch.Generator().manual_seed(0)
    head_dim = 16
    key_cache, value_cache, tables, keys, values = _paged_cache(seq_lens, block_size, num_kv_heads, head_dim,
                                                                torch.float32, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    lens = torch.tensor(seq_lens)
    out = kernels.paged_decode_attention(*_to(q, key_cache, value_cache, tables, lens), scale,
                                         max_seq_len=max(seq_lens)).cpu()
    for i, n in enumerate(seq_lens):
        want = _reference(q[i: i + 1], keys[i], values[i], n - 1, scale)
        torch.testing.assert_close(out[i: i + 1].double(), want, atol=2e-5, rtol=2e-5)


def test_decode_split_bound_and_padded_rows():
    """A grid sized for a longer bound (as a CUDA graph replays it) gives the same rows, and a
    padded row (length 0) gives zeros, not NaN."""
    gen = torch.Generator().manual_seed(1)
    seq_lens = [9, 50]
    key_cache, value_cache, tables, keys, values = _paged_cache(seq_lens, 16, 2, 32, torch.float32, gen)
    q = torch.randn(3, 4, 32, generator=gen)
    tables = torch.cat([tables, torch.zeros(1, tables.shape[1], dtype=torch.int64)])
    lens = torch.tensor(seq_lens + [0])
    assert kernels.num_decode_splits(3, 2, 256)[0] > 1
    out = kernels.paged_decode_attention(*_to(q, key_cache, value_cache, tables, lens), 0.2, max_seq_len=256).cpu()
    for i, n in enumerate(seq_lens):
        torch.testing.assert_close(out[i: i + 1].double(), _reference(q[i: i + 1], keys[i], values[i], n - 1, 0.2),
                                   atol=2e-5, rtol=2e-5)
    assert torch.equal(out[2], torch.zeros(4, 32))


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,chunks", [
    # (context already cached, chunk length) per sequence
    (16, 2, 2, [(0, 20), (0, 1)]),             # first chunks, ragged
    (8, 4, 2, [(24, 9), (5, 17), (0, 33)]),    # chunks over cached context, GQA 2, several query tiles
    (32, 3, 1, [(40, 16)]),                    # MQA, a context that is not a tile multiple
])
def test_prefill_matches_reference(block_size, num_heads, num_kv_heads, chunks):
    gen = torch.Generator().manual_seed(2)
    head_dim = 16
    seq_lens = [c + n for c, n in chunks]
    key_cache, value_cache, tables, keys, values = _paged_cache(seq_lens, block_size, num_kv_heads, head_dim,
                                                                torch.float32, gen)
    q_lens = [n for _, n in chunks]
    starts = torch.tensor([0] + q_lens).cumsum(0)
    q = torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    q_d, out_d = _to(q, out)
    kernels.paged_prefill_attention(q_d, *_to(key_cache, value_cache, tables, starts, torch.tensor(seq_lens)),
                                    out_d, scale, max_query_len=max(q_lens), block_m=16, block_n=16)
    out = out_d.cpu()
    for i, (ctx, n) in enumerate(chunks):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        torch.testing.assert_close(out[rows].double(), _reference(q[rows], keys[i], values[i], ctx, scale),
                                   atol=2e-5, rtol=2e-5)


def test_prefill_bf16_close_to_reference():
    gen = torch.Generator().manual_seed(3)
    key_cache, value_cache, tables, keys, values = _paged_cache([37], 16, 2, 16, torch.bfloat16, gen)
    q = torch.randn(21, 4, 16, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    q_d, out_d = _to(q, out)
    kernels.paged_prefill_attention(q_d, *_to(key_cache, value_cache, tables, torch.tensor([0, 21]),
                                              torch.tensor([37])), out_d, 0.25, max_query_len=21,
                                    block_m=16, block_n=16)
    want = _reference(q.float(), keys[0].float(), values[0].float(), 16, 0.25)
    torch.testing.assert_close(out_d.cpu().double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_slots_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(4)
    num_kv_heads, head_dim = 2, 8
    qkv = torch.randn(5, (4 + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)  # a fused QKV output
    k = qkv[:, 4 * head_dim: 6 * head_dim].view(5, num_kv_heads, head_dim)  # row-strided views
    v = qkv[:, 6 * head_dim:].view(5, num_kv_heads, head_dim)
    key_cache = torch.zeros(4, 4, num_kv_heads, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([7, 0, -1, 15, 3])
    kd, vd, kc, vc, sd = _to(k, v, key_cache, value_cache, slots)
    kernels.store_kv(kd, vd, kc, vc, sd)
    want_k, want_v = key_cache.view(-1, num_kv_heads, head_dim).clone(), value_cache.view(-1, num_kv_heads, head_dim).clone()
    keep = slots >= 0
    want_k[slots[keep]] = k[keep]
    want_v[slots[keep]] = v[keep]
    assert torch.equal(kc.cpu().view_as(want_k), want_k)
    assert torch.equal(vc.cpu().view_as(want_v), want_v)
