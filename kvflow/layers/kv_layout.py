"""How a block of the CPU KV pool stores its keys and values.

Values are token-major, [block_size, num_kv_heads, head_dim] per block: p.V reads a token's
value rows in order. Keys are dimension-major per KV head, in 4-byte cells of G consecutive
dims (G = 1 in float32, 2 in 16-bit dtypes): [num_kv_heads, head_dim / G, block_size, G] per
block. A decode step's q.k then multiplies one q element (or dim pair, for vdpbf16ps) into 16
consecutive keys with one 64-byte load and needs no horizontal sums; token-major keys cost a
transpose-add per 16 keys (measured 11 % slower decode attention in float32, 15 % in bf16).

Both caches keep the logical shape [num_blocks, block_size, num_kv_heads, head_dim], so the
shape carries the geometry, but a key cache's elements are in the order above: read and write
keys through these helpers (the C++ kernels use the same layout, csrc/common.h).
"""

from __future__ import annotations

import torch


def key_group(dtype: torch.dtype) -> int:
    """G: consecutive dims of a key kept together in one 4-byte cell."""
    return max(1, 4 // torch.empty((), dtype=dtype).element_size())


def key_blocks(key_cache: torch.Tensor) -> torch.Tensor:
    """The key cache as it is stored: [num_blocks, num_kv_heads, head_dim / G, block_size, G]."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    group = key_group(key_cache.dtype)
    return key_cache.view(num_blocks, num_kv_heads, head_dim // group, block_size, group)


def keys_token_major(key_cache: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of (some blocks of) a key cache as [num_blocks, block_size, num_kv_heads,
    head_dim]."""
    return key_blocks(key_cache).permute(0, 3, 1, 2, 4).contiguous().view(key_cache.shape)


def write_keys(key_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor) -> None:
    """key_cache[slot_mapping[t]] = k[t] for k [tokens, num_kv_heads, head_dim]."""
    block_size = key_cache.shape[1]
    cells = key_blocks(key_cache)
    cells[slot_mapping // block_size, :, :, slot_mapping % block_size, :] = k.reshape(
        k.shape[0], cells.shape[1], cells.shape[2], cells.shape[4])


def key_cache_from_token_major(keys: torch.Tensor) -> torch.Tensor:
    """The stored layout of keys given as [num_blocks, block_size, num_kv_heads, head_dim] (a
    new tensor of that logical shape): for tests and tools that build a cache by hand."""
    num_blocks, block_size, num_kv_heads, head_dim = keys.shape
    group = key_group(keys.dtype)
    cells = keys.reshape(num_blocks, block_size, num_kv_heads, head_dim // group, group).permute(0, 2, 3, 1, 4)
    return cells.contiguous().view(keys.shape)
