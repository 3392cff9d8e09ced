"""The CUDA attention backend against the CPU backend on one mixed step (decodes, a first chunk
and a chunk over cached context), through the same interface the model calls. Without a GPU its
Triton kernels run under the interpreter on CPU tensors (tests/layers/triton/interpreter.py)."""

from __future__ import annotations

import torch

from kvflow.layers import kv_layout
from kvflow.layers.attention import AttentionMetadata, CPUAttentionBackend, get_attn_backend
from tests.layers.triton.interpreter import DEVICE, load_kernels

load_kernels()
from kvflow.layers.cuda_attention import CUDAAttentionBackend  # noqa: E402


def _step(block_size: int, num_blocks: int):
    """Two decodes (contexts 20 and 5), a 9-token first chunk, a 6-token chunk after 11 cached."""
    contexts, new = [20, 5, 0, 11], [1, 1, 9, 6]
    gen = torch.Generator().manual_seed(7)
    perm = torch.randperm(num_blocks, generator=gen)
    lens = [c + n for c, n in zip(contexts, new)]
    width = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used: used + nb]
        used += nb
    pos = [torch.arange(c, c + n) for c, n in zip(contexts, new)]
    slots = torch.cat([tables[i, p // block_size] * block_size + p % block_size for i, p in enumerate(pos)])
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=starts, seq_lens=lens, block_tables=tables,
                             num_decodes=2, block_size=block_size)
    cached = [(i, torch.arange(c)) for i, c in enumerate(contexts) if c]
    return meta, cached, starts[-1], gen


def test_cuda_backend_matches_cpu_backend_on_a_mixed_step():
    block_size, num_blocks, heads, kv_heads, dim = 8, 12, 4, 2, 16
    meta, cached, num_tokens, gen = _step(block_size, num_blocks)
    cpu, cuda = CPUAttentionBackend(), CUDAAttentionBackend(DEVICE)
    assert get_attn_backend("cpu").name == "cpu"
    cpu_cache = cpu.allocate_kv_caches(1, num_blocks, block_size, kv_heads, dim, torch.float32)[0]
    gpu_cache = cuda.allocate_kv_caches(1, num_blocks, block_size, kv_heads, dim, torch.float32)[0]
    assert gpu_cache.device.type == DEVICE and gpu_cache.shape == cpu_cache.shape
    for i, positions in cached:  # the context earlier steps left in the cache, in each layout
        slots = meta.block_tables[i, positions // block_size] * block_size + positions % block_size
        k, v = torch.randn(2, len(positions), kv_heads, dim, generator=gen)
        kv_layout.write_keys(cpu_cache[0], slots, k)
        cpu_cache[1].view(-1, kv_heads, dim)[slots] = v
        gpu_cache[0].view(-1, kv_heads, dim)[slots.to(DEVICE)] = k.to(DEVICE)
        gpu_cache[1].view(-1, kv_heads, dim)[slots.to(DEVICE)] = v.to(DEVICE)
    q = torch.randn(num_tokens, heads, dim, generator=gen)
    k, v = torch.randn(2, num_tokens, kv_heads, dim, generator=gen)
    want = cpu.forward(q, k, v, cpu_cache, meta, 0.25)
    got = cuda.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), gpu_cache, meta.to(torch.device(DEVICE)), 0.25)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    # Both pools now hold the same keys and values, each in its own layout.
    assert torch.equal(kv_layout.keys_token_major(cpu_cache[0]), gpu_cache[0].cpu())
    assert torch.equal(cpu_cache[1], gpu_cache[1].cpu())
