"""CPUAttentionBackend on a mixed step (decodes, then prefill chunks), with and without the kernels.

Guards:
  - the compiled decode kernel and the PyTorch decode path give the same outputs, and both match a
    float64 reference of causal attention over each sequence's context;
  - the step's new K/V land in exactly the slots the slot mapping names, and nothing else moves;
  - with the kernels, the cache may stay unwritten (`torch.empty`): slots outside every sequence's
    tokens are filled with NaN here and must never reach an output.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.layers import cpu_kernels, kv_layout
from kvflow.layers.attention import AttentionMetadata, CPUAttentionBackend
from tests.conftest import huge_kib_under, thp_mode

NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 4, 24

# (tokens already in the cache, new tokens this step); decodes first, as the model runner orders them.
STEP = [
    (9, 1),  # decode over 2 full blocks and a partial one
    (3, 1),  # decode that fills its first block exactly
    (0, 7),  # first prefill chunk: attends over its own fresh K/V only
    (6, 5),  # later prefill chunk over cached context
]


def loaded_kernels():
    kernels = cpu_kernels.load()
    assert kernels is not None, "cpu_kernels.load() returned None: the build failed or KVFLOW_CPU_KERNELS=0"
    return kernels


def build_step(head_dim: int, dtype: torch.dtype, seed: int = 0):
    """Block tables from a shuffled pool, cached context, and this step's q/k/v and metadata.

    Built the way `ModelRunner.prepare_inputs` builds it: tables padded with 0, slot of token t
    = table[t // block_size] * block_size + t % block_size.
    """
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables_list, context = [], []
    for cached, new in STEP:
        n = -(-(cached + new) // BLOCK_SIZE)
        tables_list.append([pool.pop() for _ in range(n)])
    width = max(len(t) for t in tables_list)
    block_tables = torch.zeros((len(STEP), width), dtype=torch.int64)
    for row, table in enumerate(tables_list):
        block_tables[row, : len(table)] = torch.tensor(table)

    def slot(seq: int, pos: int) -> int:
        return tables_list[seq][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    # K/V of tokens cached by earlier steps: (slot, k, v) per sequence.
    for s, (cached, _) in enumerate(STEP):
        slots = torch.tensor([slot(s, p) for p in range(cached)], dtype=torch.int64)
        context.append((slots, torch.randn(cached, NUM_KV_HEADS, head_dim, generator=g).to(dtype),
                        torch.randn(cached, NUM_KV_HEADS, head_dim, generator=g).to(dtype)))

    slot_mapping = torch.tensor([slot(s, cached + i) for s, (cached, new) in enumerate(STEP) for i in range(new)])
    query_start_loc = [0]
    for _, new in STEP:
        query_start_loc.append(query_start_loc[-1] + new)
    seq_lens = [cached + new for cached, new in STEP]
    num_decodes = sum(1 for _, new in STEP if new == 1)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        num_decodes=num_decodes,
        block_size=BLOCK_SIZE,
    )
    total = query_start_loc[-1]
    q = torch.randn(total, NUM_HEADS, head_dim, generator=g).to(dtype)
    k = torch.randn(total, NUM_KV_HEADS, head_dim, generator=g).to(dtype)
    v = torch.randn(total, NUM_KV_HEADS, head_dim, generator=g).to(dtype)
    return q, k, v, meta, context


def fresh_cache(backend: CPUAttentionBackend, head_dim: int, dtype: torch.dtype, context, poison: bool):
    """The backend's own allocation with the cached context written in; `poison` fills every
    other slot with NaN (stale K/V of freed blocks: readers must never look past a length)."""
    kv_cache = backend.allocate_kv_caches(1, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim, dtype)[0]
    assert kv_cache.shape == (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim) and kv_cache.dtype == dtype
    if poison:
        kv_cache.fill_(float("nan"))
    for slots, ck, cv in context:
        kv_layout.write_keys(kv_cache[0], slots, ck)
        kv_cache[1].view(-1, NUM_KV_HEADS, head_dim)[slots] = cv
    return kv_cache


def reference_step(q, k, v, meta, context, scale):
    """float64 causal attention per sequence over [context, new tokens], straight from the math."""
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(meta.num_seqs):
        start, end = meta.query_start_loc[s], meta.query_start_loc[s + 1]
        _, ck, cv = context[s]
        keys = torch.cat([ck, k[start:end]]).double().repeat_interleave(group, dim=1)  # [L, H, D]
        values = torch.cat([cv, v[start:end]]).double().repeat_interleave(group, dim=1)
        n, total = end - start, keys.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), keys) * scale
        future = torch.arange(total)[None, :] > torch.arange(n)[:, None] + (total - n)
        scores.masked_fill_(future, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)
    return out


@pytest.mark.parametrize("head_dim", [64, 40], ids=["d64-avx512", "d40-portable"])
def test_kernel_and_torch_decode_agree_on_a_mixed_step(head_dim):
    loaded_kernels()
    torch.manual_seed(0)
    dtype, scale = torch.float32, head_dim**-0.5
    q, k, v, meta, context = build_step(head_dim, dtype)
    with_kernels, without = CPUAttentionBackend(use_kernels=True), CPUAttentionBackend(use_kernels=False)
    assert with_kernels.kernels is not None and without.kernels is None

    cache_k = fresh_cache(with_kernels, head_dim, dtype, context, poison=True)
    cache_t = fresh_cache(without, head_dim, dtype, context, poison=True)
    out_k = with_kernels.forward(q, k, v, cache_k, meta, scale)
    out_t = without.forward(q, k, v, cache_t, meta, scale)

    assert not torch.isnan(out_k).any(), "the kernel backend read an unwritten (NaN) slot"
    torch.testing.assert_close(out_k, out_t, rtol=1e-5, atol=1e-5)
    ref = reference_step(q, k, v, meta, context, scale)
    torch.testing.assert_close(out_k.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_t.double(), ref, rtol=1e-5, atol=1e-5)


def test_kernel_and_torch_decode_agree_in_bf16():
    """bf16: both round probabilities to bf16, but PyTorch's matmuls sum in their own order (the
    kernel follows kvflow's attention numerics), so the two agree to bf16 precision, not bitwise."""
    loaded_kernels()
    head_dim, dtype = 64, torch.bfloat16
    q, k, v, meta, context = build_step(head_dim, dtype, seed=3)
    nd = meta.num_decodes
    with_kernels, without = CPUAttentionBackend(use_kernels=True), CPUAttentionBackend(use_kernels=False)
    out_k = with_kernels.forward(q, k, v, fresh_cache(with_kernels, head_dim, dtype, context, True), meta, 0.125)
    out_t = without.forward(q, k, v, fresh_cache(without, head_dim, dtype, context, False), meta, 0.125)
    assert out_k.dtype == dtype and not torch.isnan(out_k).any()
    torch.testing.assert_close(out_k[:nd].float(), out_t[:nd].float(), rtol=2e-2, atol=2e-2)
    ref = reference_step(q, k, v, meta, context, 0.125)
    torch.testing.assert_close(out_k[:nd].double(), ref[:nd], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch"])
def test_new_kv_lands_in_the_mapped_slots(use_kernels):
    if use_kernels:
        loaded_kernels()
    head_dim, dtype = 64, torch.float32
    q, k, v, meta, context = build_step(head_dim, dtype, seed=1)
    backend = CPUAttentionBackend(use_kernels=use_kernels)
    kv_cache = fresh_cache(backend, head_dim, dtype, context, poison=True)
    expected = kv_cache.clone()
    expected_keys = kv_layout.keys_token_major(expected[0])
    for i, slot in enumerate(meta.slot_mapping.tolist()):  # the written slots, one token at a time
        expected_keys.view(-1, NUM_KV_HEADS, head_dim)[slot] = k[i]
        expected[1].view(-1, NUM_KV_HEADS, head_dim)[slot] = v[i]
    expected[0] = kv_layout.key_cache_from_token_major(expected_keys)

    backend.forward(q, k, v, kv_cache, meta, head_dim**-0.5)

    flat_k = kv_layout.keys_token_major(kv_cache[0]).view(-1, NUM_KV_HEADS, head_dim)
    flat_v = kv_cache[1].view(-1, NUM_KV_HEADS, head_dim)
    assert torch.equal(flat_k[meta.slot_mapping], k)
    assert torch.equal(flat_v[meta.slot_mapping], v)
    # Token t of sequence s sits at block_table[s, t // block_size] * block_size + t % block_size.
    for s in range(meta.num_seqs):
        start, end = meta.query_start_loc[s], meta.query_start_loc[s + 1]
        for i, pos in enumerate(range(meta.seq_lens[s] - (end - start), meta.seq_lens[s])):
            block = meta.block_tables[s, pos // BLOCK_SIZE]
            assert torch.equal(flat_k[block * BLOCK_SIZE + pos % BLOCK_SIZE], k[start + i])
            assert torch.equal(kv_cache[1, block, pos % BLOCK_SIZE], v[start + i])
    # Nothing else moved: cached context intact, unwritten slots untouched.
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0, equal_nan=True)


def test_torch_fallback_never_reads_unwritten_slots():
    kernels = loaded_kernels()
    head_dim, dtype = 64, torch.float16  # an engine dtype the kernel does not take
    assert not kernels.supports(dtype, NUM_HEADS, NUM_KV_HEADS, head_dim)
    q, k, v, meta, context = build_step(head_dim, dtype, seed=2)
    backend = CPUAttentionBackend(use_kernels=True)
    out = backend.forward(q, k, v, fresh_cache(backend, head_dim, dtype, context, poison=True), meta, 0.125)
    assert not torch.isnan(out[: meta.num_decodes]).any()


def test_kv_caches_are_one_zeroed_pool_on_huge_pages():
    """The layers' caches are views of one pool, resident and zero from the start, on 2 MiB pages."""
    if thp_mode() not in ("always", "madvise"):
        pytest.skip("transparent huge pages are off on this machine (a kernel setting, not kvflow's)")
    caches = CPUAttentionBackend().allocate_kv_caches(4, 1024, 16, 4, 64, torch.bfloat16)  # 4 x 16 MiB
    assert len(caches) == 4 and all(c.shape == (2, 1024, 16, 4, 64) and c.is_contiguous() for c in caches)
    layer_bytes = caches[0].numel() * caches[0].element_size()
    assert all(b.data_ptr() - a.data_ptr() == layer_bytes for a, b in zip(caches, caches[1:]))
    assert not any(c.any() for c in caches)
    assert sum(huge_kib_under(c) for c in caches) >= 32 << 10
