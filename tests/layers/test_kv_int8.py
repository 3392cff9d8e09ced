"""The int8 KV cache (layers/kv_int8.py, csrc/kv_int8.cpp).

Guards:
  - quantization: each token's head within half a step of its float value, the float16 scale
    exactly what is stored, an all-zero head stored as zeros;
  - the compiled kernel, reading the int8 blocks in place (csrc/int8_attention.h), agrees
    tightly with the float32 kernels over a float32 cache holding the dequantized values, for
    decode rows and prefill chunks in one call, GQA groups 1 and 3, block sizes 16 and 5,
    shuffled block tables; its AVX-512 path gives the portable path's bits (natively, or
    emulated through SIMDe where the CPU lacks AVX-512);
  - one row, the same bits whether computed as a decode, in one prefill chunk or in chunks
    over cached context;
  - the PyTorch path over the same dequantized blocks agrees to float32 rounding;
  - through the backend: writes land in the mapped slots with their scales; bf16 queries;
  - refusals name the option and the supported values.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvflow.layers import kv_int8, kv_layout
from kvflow.layers.attention import AttentionMetadata, CPUAttentionBackend

# (tokens already cached, new tokens this step) per sequence; one-token rows first are decodes.
STEP = [(40, 1), (0, 1), (130, 1), (0, 37), (50, 20), (3, 70)]


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format, written out independently: scale = float16(max|x| / 127), q = round(x / scale)."""
    scale = (x.float().abs().amax(-1) / 127).to(torch.float16)
    s = scale.float()[..., None]
    q = torch.where(s > 0, (x.float() / torch.where(s > 0, s, torch.ones_like(s))).round(), torch.zeros_like(s))
    return q.clamp(-127, 127).to(torch.int8), scale


def test_quantize_matches_the_format_and_stays_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0
    q, scale = kv_int8.quantize(x)
    ref_q, ref_scale = reference_quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
    deq = q.float() * scale.float()[..., None]
    assert torch.all((deq - x).abs() <= scale.float()[..., None] * 0.5 + 1e-6 * x.abs())
    assert torch.all(q[7, 1] == 0) and scale[7, 1] == 0
    assert q.abs().max() == 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_write_equals_quantize_over_a_wide_range(kernels, dtype):
    """Scales from float16's subnormals (heads of 1e-9) to its overflow (1e7), zero heads, and
    K/V as row-strided views of one fused tensor, as the model passes them."""
    torch.manual_seed(1)
    tokens, heads, dim, block_size = 300, 3, 64, 16
    magnitude = torch.logspace(-9, 7, tokens)[:, None, None]
    fused = (torch.randn(tokens, 2 * heads * dim) * magnitude.view(tokens, 1)).to(dtype)
    fused[5] = 0
    k, v = fused[:, : heads * dim].view(tokens, heads, dim), fused[:, heads * dim :].view(tokens, heads, dim)
    slots = torch.randperm(32 * block_size)[:tokens]
    caches = [CPUAttentionBackend().allocate_kv_caches(1, 32, block_size, heads, dim, dtype, "int8")[0] for _ in range(2)]
    kv_int8.write(caches[0], k, v, slots, kernels)
    kv_int8.write(caches[1], k, v, slots, None)
    assert torch.equal(caches[0].data, caches[1].data)
    assert torch.equal(caches[0].scales.view(torch.int16), caches[1].scales.view(torch.int16))
    ref_q, ref_scale = reference_quantize(k.float().clamp(-65504 * 127, 65504 * 127))
    assert torch.equal(caches[0].scales[0].view(-1, heads)[slots], ref_scale)


def build(num_heads: int, num_kv_heads: int, block_size: int, head_dim: int = 64, seed: int = 0):
    """A step over an int8 cache whose context was written earlier; returns (backend, cache,
    meta, q, k, v)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in STEP]
    num_blocks = sum(blocks_needed) + 4
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, slots, positions = [], [], []
    for (context, new), need in zip(STEP, blocks_needed):
        table = [ids.pop() for _ in range(need)]
        tables.append(table)
        for p in range(context + new):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
    backend = CPUAttentionBackend()
    cache = backend.allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, "int8")[0]
    total = sum(c + n for c, n in STEP)
    k_all, v_all = torch.randn(total, num_kv_heads, head_dim), torch.randn(total, num_kv_heads, head_dim) * 3
    # The cached context, written as earlier steps would have.
    context_rows, new_rows, offset = [], [], 0
    for context, new in STEP:
        context_rows += range(offset, offset + context)
        new_rows += range(offset + context, offset + context + new)
        offset += context + new
    slots_t = torch.tensor(slots)
    kv_int8.write(cache, k_all[context_rows], v_all[context_rows], slots_t[context_rows], backend.kernels)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=slots_t[new_rows],
        query_start_loc=[0, *torch.tensor([n for _, n in STEP]).cumsum(0).tolist()],
        seq_lens=[c + n for c, n in STEP],
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=3,  # the first three rows of STEP
        block_size=block_size,
    )
    q = torch.randn(len(new_rows), num_heads, head_dim)
    return backend, cache, meta, q, k_all[new_rows], v_all[new_rows]


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(3, 3, 16), (9, 3, 16), (9, 3, 5), (6, 2, 32)])
def test_kernel_agrees_with_the_float32_kernels_over_the_dequantized_cache(kernels, num_heads, num_kv_heads,
                                                                          block_size):
    """The scales are folded into the scores and the probabilities instead of into every
    element, which moves a few roundings: float32 agreement, not bits."""
    backend, cache, meta, q, k, v = build(num_heads, num_kv_heads, block_size)
    out = backend.forward(q, k, v, cache, meta, 0.125)
    key_cache, value_cache = cache.dequantized()
    nd = meta.num_decodes
    decode = kernels.paged_decode_attention(q[:nd].contiguous(), key_cache, value_cache, meta.block_tables[:nd].contiguous(),
                                            meta.seq_lens_tensor[:nd].contiguous(), 0.125)
    prefill = torch.empty_like(q)
    kernels.paged_prefill_attention(q, key_cache, value_cache, meta.block_tables[nd:].contiguous(),
                                    meta.query_start_tensor[nd:].contiguous(), meta.seq_lens_tensor[nd:].contiguous(),
                                    prefill, 0.125)
    torch.testing.assert_close(out[:nd], decode, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[nd:], prefill[nd:], atol=2e-5, rtol=1e-5)
    assert not out.isnan().any()


@pytest.fixture(scope="module")
def avx512(kernels):
    """The kernels with their AVX-512 paths: native where the CPU has them, else emulated."""
    if kernels.decode_fast_path(torch.float32, 64):
        return kernels
    from kvflow.layers import cpu_kernels

    return cpu_kernels.load_emulated_avx512()


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size,head_dim", [(9, 3, 16, 64), (9, 3, 5, 64), (4, 4, 32, 80),
                                                                        (6, 2, 16, 32)])
def test_avx512_path_gives_the_portable_bits(avx512, num_heads, num_kv_heads, block_size, head_dim):
    backend, cache, meta, q, k, v = build(num_heads, num_kv_heads, block_size, head_dim)
    kv_int8.write(cache, k, v, meta.slot_mapping, avx512)
    for dtype in (torch.float32, torch.bfloat16):
        fast = kv_int8.paged_attention(avx512, q.to(dtype), cache, meta, 0.125)
        portable = kv_int8.paged_attention(avx512, q.to(dtype), cache, meta, 0.125, portable=True)
        assert fast.dtype == dtype and not fast.isnan().any()
        bad = [t for t in range(q.shape[0]) if not torch.equal(fast[t], portable[t])]
        assert not bad, f"{dtype}: the AVX-512 rows differ from the portable ones at {bad[:10]}"


def _one_sequence(kernels, seq_len: int, block_size: int, num_kv_heads: int = 3, head_dim: int = 64):
    g = torch.Generator().manual_seed(block_size)
    num_blocks = -(-seq_len // block_size) + 3
    table = torch.randperm(num_blocks, generator=g)[: -(-seq_len // block_size)]
    cache = CPUAttentionBackend().allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim, torch.float32,
                                                     "int8")[0]
    positions = torch.arange(seq_len)
    slots = table[positions // block_size] * block_size + positions % block_size
    k, v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g), torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    kv_int8.write(cache, k, v, slots, kernels)
    return cache, table


def _meta(table, query_lens, seq_lens, block_size, num_decodes):
    return AttentionMetadata(slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
                             query_start_loc=[0, *torch.tensor(query_lens).cumsum(0).tolist()], seq_lens=seq_lens,
                             block_tables=table.expand(len(seq_lens), -1).contiguous(), num_decodes=num_decodes,
                             block_size=block_size)


@pytest.mark.parametrize("block_size", [16, 5])
def test_a_row_gets_the_same_bits_as_decode_chunk_or_whole_prompt(avx512, block_size):
    seq_len, heads = 83, 9
    cache, table = _one_sequence(avx512, seq_len, block_size)
    q = torch.randn(seq_len, heads, 64, generator=torch.Generator().manual_seed(3))
    whole = kv_int8.paged_attention(avx512, q, cache, _meta(table, [seq_len], [seq_len], block_size, 0), 0.125)
    decodes = kv_int8.paged_attention(avx512, q, cache, _meta(table, [1] * seq_len, list(range(1, seq_len + 1)),
                                                              block_size, seq_len), 0.125)
    assert torch.equal(decodes, whole)
    for size in (1, 7, 33, 64):
        lens = [min(size, seq_len - i) for i in range(0, seq_len, size)]
        done, parts = 0, []
        for n in lens:
            parts.append(kv_int8.paged_attention(avx512, q[done:done + n], cache,
                                                 _meta(table, [n], [done + n], block_size, 0), 0.125))
            done += n
        assert torch.equal(torch.cat(parts), whole), f"chunks of {size} differ from the whole prompt"


def test_pytorch_path_agrees_with_the_kernel(kernels):
    backend, cache, meta, q, k, v = build(9, 3, 16)
    out = backend.forward(q, k, v, cache, meta, 0.125)
    fallback = CPUAttentionBackend(use_kernels=False)
    again = fallback.forward(q, k, v, cache, meta, 0.125)  # rewrites the same K/V: same bits
    torch.testing.assert_close(again, out, atol=1e-5, rtol=1e-5)


def test_writes_land_in_their_slots_with_their_scales():
    backend, cache, meta, q, k, v = build(3, 3, 16)
    backend.forward(q, k, v, cache, meta, 0.125)
    qk, sk = reference_quantize(k)
    qv, sv = reference_quantize(v)
    slots = meta.slot_mapping
    keys = kv_layout.keys_token_major(cache.data[0]).view(-1, 3, 64)
    assert torch.equal(keys[slots], qk) and torch.equal(cache.data[1].view(-1, 3, 64)[slots], qv)
    assert torch.equal(cache.scales[0].view(-1, 3)[slots], sk) and torch.equal(cache.scales[1].view(-1, 3)[slots], sv)


def test_bf16_queries_get_bf16_rows_of_the_float32_computation():
    backend, cache, meta, q, k, v = build(9, 3, 16)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out32 = backend.forward(q.float(), k.float(), v.float(), cache, meta, 0.125)
    out16 = backend.forward(q, k, v, cache, meta, 0.125)
    assert out16.dtype == torch.bfloat16
    assert torch.equal(out16, out32.bfloat16())


def test_refusals_name_the_option():
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'fp8' .* auto, int8"):
        kv_int8.check_kv_cache_dtype("fp8")
    with pytest.raises(ValueError, match="head_dim 62 is not a multiple of 4"):
        CPUAttentionBackend(use_kernels=False).allocate_kv_caches(1, 4, 16, 2, 62, torch.float32, "int8")


def test_pool_is_int8_with_float16_scales_and_zeroed():
    caches = CPUAttentionBackend().allocate_kv_caches(3, 8, 16, 2, 64, torch.bfloat16, "int8")
    assert len(caches) == 3
    for c in caches:
        assert c.data.dtype == torch.int8 and c.data.shape == (2, 8, 16, 2, 64) and not c.data.any()
        assert c.scales.dtype == torch.float16 and c.scales.shape == (2, 8, 16, 2) and not c.scales.any()
    assert caches[1].data.data_ptr() == caches[0].data.data_ptr() + caches[0].data.numel()
