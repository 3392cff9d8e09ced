"""Triton kernels of the CUDA attention backend (`layers/cuda_attention.py`).

Imported only by that backend, so a CPU-only machine never imports triton. Every kernel also
runs under Triton's interpreter (`TRITON_INTERPRET=1`, set before this package is imported) on
CPU tensors; that is how tests/layers/triton checks them without a GPU.

KV layout of the CUDA pool: keys and values alike are token-major, one
[num_blocks, block_size, num_kv_heads, head_dim] tensor each (the logical shape the CPU pool
also has, without the CPU's dimension-major keys: a GPU reads a (token, KV head) row of
head_dim elements as one coalesced load, and the dot products run on tensor cores, which want
[keys, dims] tiles). Token `t` of a sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size`.
"""

from kvflow.layers.triton.decode import paged_decode_attention, num_decode_splits
from kvflow.layers.triton.prefill import paged_prefill_attention
from kvflow.layers.triton.store import store_kv

__all__ = ["num_decode_splits", "paged_decode_attention", "paged_prefill_attention", "store_kv"]
