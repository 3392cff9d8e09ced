"""kvflow.layers.kv_layout: where a key lives in a block of the pool, and the helpers that
every PyTorch path (and the tests) use to read and write keys in that layout.

Guards:
  - the documented offset of (token t, KV head h, dim d) within a block, in float32 (one dim per
    4-byte cell) and bf16 (dim pairs), which csrc/common.h's key_offset must match;
  - token-major -> stored -> token-major is the identity; write_keys lands each key where
    keys_token_major finds it and touches nothing else.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.layers import kv_layout

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
def test_key_offset_within_a_block(dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 3, 16, 2, 8
    group = kv_layout.key_group(dtype)
    assert group == (1 if dtype == torch.float32 else 2)
    keys = torch.arange(num_blocks * block_size * num_kv_heads * head_dim, dtype=torch.float32) % 251
    keys = keys.view(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)  # integers < 256: exact in bf16
    stored = kv_layout.key_cache_from_token_major(keys).view(num_blocks, -1)
    for b, t, h, d in [(0, 0, 0, 0), (1, 5, 1, 3), (2, 15, 0, 7), (1, 0, 1, 6), (0, 9, 1, 1)]:
        offset = ((h * (head_dim // group) + d // group) * block_size + t) * group + d % group
        assert stored[b, offset] == keys[b, t, h, d], (b, t, h, d)


@DTYPES
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_round_trip_and_write_keys(dtype, block_size):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim = 4, 3, 64
    keys = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    stored = kv_layout.key_cache_from_token_major(keys)
    assert stored.shape == keys.shape
    assert torch.equal(stored, keys) == (block_size == 1)  # one token per block: the layouts coincide
    assert torch.equal(kv_layout.keys_token_major(stored), keys)

    slots = torch.randperm(num_blocks * block_size, generator=g)[: num_blocks * block_size // 2 + 1]
    new = torch.randn(slots.shape[0], num_kv_heads, head_dim, generator=g).to(dtype)
    kv_layout.write_keys(stored, slots, new)
    expected = keys.clone().view(-1, num_kv_heads, head_dim)
    expected[slots] = new
    assert torch.equal(kv_layout.keys_token_major(stored).view(-1, num_kv_heads, head_dim), expected)
