"""The KV store: a step's new K/V rows into their slots of the paged pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, key_cache, value_cache, slot_mapping, num_tokens,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_mapping + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    head, dim = idx // HEAD_DIM, idx % HEAD_DIM
    # A negative slot is a padded row (CUDA graph replays): nothing to write.
    mask = (slots >= 0)[:, None] & (idx < NUM_KV_HEADS * HEAD_DIM)[None, :]
    k = tl.load(k_ptr + tokens[:, None] * stride_kt + (head * stride_kh + dim)[None, :], mask=mask)
    v = tl.load(v_ptr + tokens[:, None] * stride_vt + (head * stride_vh + dim)[None, :], mask=mask)
    dst = slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + idx[None, :]
    tl.store(key_cache + dst, k.to(key_cache.dtype.element_ty), mask=mask)
    tl.store(value_cache + dst, v.to(value_cache.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key_cache.view(-1, H, D)[slot_mapping[t]] = k[t] (and v), skipping slots < 0.

    k, v: [T, num_kv_heads, head_dim], each head's dims contiguous (row-strided views into a
    fused QKV output are fine); caches: contiguous [num_blocks, block_size, num_kv_heads, head_dim].
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("store_kv: head dims must be contiguous and the caches contiguous")
    width = num_kv_heads * head_dim
    block = min(1024, triton.next_power_of_2(width))
    block_t = max(1, min(16, 4096 // block))  # a tile of tokens x (heads x dims) per program
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(width, block))](
        k, v, key_cache, value_cache, slot_mapping, num_tokens, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK=block)
