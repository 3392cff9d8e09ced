"""`CPUKernels.write_kv`: a step's new K/V copied into the paged pool by slot.

Guards:
  - every token's K/V land exactly in its slot and nothing else in the pool changes (compared bitwise,
    NaN included, with `index_copy_` on a clone), in float32 and bfloat16, with k/v given as
    row-strided views of one fused QKV tensor, for a small step and one large enough to be split
    across OpenMP threads;
  - inputs the kernel cannot take raise ValueError: a dtype other than the pool's, heads that do not
    match the pool, non-contiguous heads, a non-int64 slot mapping.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.layers import kv_layout


def fused_step(tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """k and v as views into a [T, (H + 2 KVH) * D] QKV output (rows strided, heads contiguous)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    _, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return k.view(tokens, num_kv_heads, head_dim), v.view(tokens, num_kv_heads, head_dim)


def pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1):
    """[2, blocks, block_size, KVH, D]: random context, with some slots NaN (never written)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    cache[:, ::3] = float("nan")
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens, num_kv_heads, head_dim", [(5, 2, 64), (600, 2, 128)], ids=["small", "threaded"])
def test_write_kv_writes_exactly_the_mapped_slots(kernels, tokens, num_kv_heads, head_dim, dtype):
    block_size = 16
    num_blocks = -(-2 * tokens // block_size) + 1
    k, v = fused_step(tokens, 6, num_kv_heads, head_dim, dtype)
    assert not k.is_contiguous() and k.stride(1) == head_dim
    cache = pool(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    g = torch.Generator().manual_seed(2)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=g)[:tokens]  # scattered, distinct

    expected = cache.clone()
    kv_layout.write_keys(expected[0], slot_mapping, k)
    expected[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    kernels.write_kv(k, v, cache[0], cache[1], slot_mapping)

    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)
    keys = kv_layout.keys_token_major(cache[0]).view(-1, num_kv_heads, head_dim)
    values = cache[1].view(-1, num_kv_heads, head_dim)
    assert torch.equal(keys[slot_mapping], k) and torch.equal(values[slot_mapping], v)


def test_write_kv_rejects_what_it_cannot_take(kernels):
    k, v = fused_step(4, 4, 2, 64, torch.float32)
    cache = pool(3, 4, 2, 64, torch.bfloat16)
    slots = torch.tensor([0, 5, 6, 11])
    before = cache.clone()
    with pytest.raises(ValueError, match="dtype"):  # float32 K/V into a bf16 pool
        kernels.write_kv(k, v, cache[0], cache[1], slots)
    k, v = k.bfloat16(), v.bfloat16()
    with pytest.raises(ValueError):  # one KV head where the pool holds two
        kernels.write_kv(k[:, :1], v[:, :1], cache[0], cache[1], slots)
    with pytest.raises(ValueError):  # heads not contiguous
        kernels.write_kv(k.transpose(1, 2).contiguous().transpose(1, 2), v, cache[0], cache[1], slots)
    with pytest.raises(ValueError, match="int64"):
        kernels.write_kv(k, v, cache[0], cache[1], slots.int())
    with pytest.raises(ValueError, match="one slot per token"):
        kernels.write_kv(k, v, cache[0], cache[1], slots[:3])
    with pytest.raises(ValueError, match="shape"):
        kernels.write_kv(k, v[:3], cache[0], cache[1], slots)
    torch.testing.assert_close(cache, before, rtol=0, atol=0, equal_nan=True)  # nothing written on a refusal
