"""Paged attention on a CUDA GPU, through kvflow's Triton kernels (`layers/triton/`).

The backend interface is the CPU backend's: the model hands each layer's q/k/v and its cache
view, the step's `AttentionMetadata` says where everything is. What differs is behind it:

- **Layout.** Keys are token-major like values ([num_blocks, block_size, KV heads, head_dim],
  `layers/triton/__init__.py`), not the CPU's dimension-major cells: a GPU loads a key row
  coalesced and multiplies [queries, dims] x [dims, keys] tiles on its tensor cores.
- **Write, then read.** The step's K/V go into their slots first (`store_kv`); decode and
  prefill rows then read every key from the pool, the chunk's own included, as the CPU
  kernels do, so a row does not depend on how its prompt was chunked or batched.
- **Decodes** (the first `num_decodes` rows) run the split-K decode kernel, whose grid depends
  only on the batch size and `max_decode_seq_len`, so a CUDA graph replays it; **prefill
  chunks** run the tiled causal kernel over their block tables.

Only imported when the engine runs on CUDA (`get_attn_backend`), so the CPU path never
imports triton.
"""

from __future__ import annotations

import torch

from kvflow.layers import kv_int8
from kvflow.layers import triton as kernels
from kvflow.layers.attention import AttentionBackend, AttentionMetadata


class CUDAAttentionBackend(AttentionBackend):
    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)

    def allocate_kv_caches(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                           kv_cache_dtype="auto"):
        if kv_int8.check_kv_cache_dtype(kv_cache_dtype) != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} runs on the CPU backend only; "
                             "use --kv-cache-dtype auto with --device cuda")
        return super().allocate_kv_caches(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)

    def _zeroed_pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        kernels.store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            bound = meta.max_decode_seq_len or max(meta.seq_lens[:nd])
            kernels.paged_decode_attention(q[:nd], key_cache, value_cache, meta.block_tables[:nd],
                                           meta.seq_lens_tensor[:nd], scale, max_seq_len=bound, out=out[:nd])
        if nd < meta.num_seqs:
            starts = meta.query_start_loc
            longest = max(starts[i + 1] - starts[i] for i in range(nd, meta.num_seqs))
            kernels.paged_prefill_attention(q, key_cache, value_cache, meta.block_tables[nd:],
                                            meta.query_start_tensor[nd:], meta.seq_lens_tensor[nd:], out, scale,
                                            max_query_len=longest)
        return out
