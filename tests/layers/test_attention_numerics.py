"""One attention numerics: a query row gives the same bits whichever kernel computes it.

docs/architecture.md ("Attention numerics") defines, per dtype, how one query row's output is
computed; the decode kernel (one query per sequence) and the prefill kernel (chunks, over
cached context or not) both follow it. So here, for one sequence's K/V in the paged pool:
  - the whole sequence as one prefill chunk is the reference;
  - every position again as a decode (alone, and all positions batched as separate sequences);
  - the same rows cut into chunks of every size from 1 on, with the earlier part as context;
must all give bitwise the same rows, whatever the block size (odd ones split the bf16 key
pairs across blocks), head_dim (an odd number of 16-dim vectors) and GQA group.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.layers import kv_layout
from tests.conftest import assert_nearly_bitwise

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=["engine", "avx512"])
def impl(request, kernels):
    """The kernels twice: as the engine runs them on this CPU (the AVX-512 paths or, without
    them, the portable reference everywhere), and with the AVX-512 paths forced: native where
    the CPU has AVX512-BF16, else emulated through SIMDe (csrc/isa.h), so that every CI machine
    checks the fast kernels' numerics too."""
    if request.param == "engine":
        return kernels
    if kernels.avx512_bf16:
        return kernels
    from kvflow.layers import cpu_kernels

    return cpu_kernels.load_emulated_avx512()


def _pool(kernels, dtype, seq_len, num_kv_heads, head_dim, block_size, seed):
    """A shuffled block table and a pool holding one sequence's K/V (written by the kernel), NaN elsewhere."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-seq_len // block_size) + 3
    table = torch.randperm(num_blocks, generator=g)[: -(-seq_len // block_size)]
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    positions = torch.arange(seq_len)
    slots = table[positions // block_size] * block_size + positions % block_size
    kernels.write_kv(k, v, key_cache, value_cache, slots)
    return key_cache, value_cache, table


def _prefill(kernels, q, key_cache, value_cache, table, chunks, scale):
    """Rows of q computed as consecutive chunks (sizes `chunks`), each over all keys before it."""
    out = torch.empty_like(q)
    done = 0
    for n in chunks:
        query_start = torch.tensor([0, n], dtype=torch.int64)
        seq_lens = torch.tensor([done + n], dtype=torch.int64)
        part = torch.empty_like(q[done:done + n])
        kernels.paged_prefill_attention(q[done:done + n].contiguous(), key_cache, value_cache, table[None].contiguous(),
                                        query_start, seq_lens, part, scale)
        out[done:done + n] = part
        done += n
    return out


def _chunks(total: int, size: int) -> list[int]:
    return [min(size, total - i) for i in range(0, total, size)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 80), (6, 2, 32)],
                         ids=["gqa3-d64", "mha-d80", "gqa3-d32"])
def test_decode_and_prefill_rows_are_bitwise_equal(impl, dtype, block_size, num_heads, num_kv_heads, head_dim):
    kernels = impl
    seq_len, scale = 83, head_dim**-0.5  # 83: odd, and not a multiple of 16 or of 64 (the q.k tile group)
    key_cache, value_cache, table = _pool(kernels, dtype, seq_len, num_kv_heads, head_dim, block_size, seed=block_size)
    q = torch.randn(seq_len, num_heads, head_dim, generator=torch.Generator().manual_seed(7)).to(dtype)

    reference = _prefill(kernels, q, key_cache, value_cache, table, [seq_len], scale)
    assert not torch.isnan(reference).any()

    # Every position as a decode: all together (one sequence per position, sharing the table)...
    tables = table[None].expand(seq_len, -1).contiguous()
    lens = torch.arange(1, seq_len + 1, dtype=torch.int64)
    batched = kernels.paged_decode_attention(q, key_cache, value_cache, tables, lens, scale)
    mismatched = [t for t in range(seq_len) if not torch.equal(batched[t], reference[t])]
    assert not mismatched, f"decode rows differ from the prefill rows at positions {mismatched[:10]}"
    # ... and a few alone (a lone sequence splits its work by KV head instead of by sequence).
    for t in (0, 1, 16, 63, 64, seq_len - 1):
        alone = kernels.paged_decode_attention(q[t:t + 1], key_cache, value_cache, table[None].contiguous(),
                                               lens[t:t + 1], scale)
        assert torch.equal(alone[0], reference[t]), f"decode of position {t} alone differs from prefill"

    # The portable reference (attention_ref.h) computes the same bits: bitwise in float32; in
    # bf16 too where vdpbf16ps is emulated as Intel documents it (on real silicon the pair sum
    # is the instruction's, so at most 1 ulp apart there).
    portable = kernels.paged_decode_attention(q, key_cache, value_cache, tables, lens, scale, portable=True)
    if dtype == torch.bfloat16 and "simde" not in kernels.path.name and kernels.avx512_bf16:
        assert_nearly_bitwise(portable, reference, max_fraction=0.05, label=" (portable vs vdpbf16ps)")
    else:
        bad = [t for t in range(seq_len) if not torch.equal(portable[t], reference[t])]
        assert not bad, f"the portable reference differs from the kernel at positions {bad[:10]}"

    # The same rows as chunks over cached context, chunk sizes from 1 (a one-token chunk) up.
    for size in (1, 2, 7, 31, 32, 33, 64):
        chunked = _prefill(kernels, q, key_cache, value_cache, table, _chunks(seq_len, size), scale)
        assert torch.equal(chunked, reference), f"prefill in chunks of {size} differs from one chunk"


@pytest.mark.parametrize("case", ["q.k", "p.V"])
@pytest.mark.parametrize("path", ["portable", "avx512"])
def test_bf16_pairs_add_the_odd_product_first(kernels, case, path):
    """The one bf16 rule that rounding to bf16 usually hides, made visible: in each dim pair (q.k)
    and key pair (p.V) the odd product is added before the even one, as vdpbf16ps does. Exact
    products of 1, then +2^24 and -2^24: odd first, 1 + 2^24 rounds to 2^24 and the pair
    cancels to 0; the other order leaves 1 (a score of 1 instead of 0; a sum of 1 instead of 0)."""
    if path == "avx512" and not kernels.avx512_bf16:
        from kvflow.layers import cpu_kernels
        kernels = cpu_kernels.load_emulated_avx512()
    keys, head_dim, block_size, big = 32, 64, 16, 2.0**12
    q = torch.zeros(1, 1, head_dim)
    k = torch.zeros(keys, 1, head_dim)
    v = torch.zeros(keys, 1, head_dim)
    if case == "q.k":  # even keys: 1*1, then in dims (2, 3) -big*big and big*big: odd first, a score of 0
        q[0, 0, 1], q[0, 0, 2], q[0, 0, 3] = 1.0, big, big
        k[0::2, 0, 1], k[0::2, 0, 2], k[0::2, 0, 3] = 1.0, -big, big
        v[0::2, 0, 5] = 1.0  # out[5]: the even keys' weight, 1/2 when every score is 0
        expected = {5: 0.5}
    else:  # every score 0, so p = 1 for each key; dim 0 sums 1 (key 1), then -2^24 (key 2) and 2^24 (key 3)
        v[1, 0, 0], v[2, 0, 0], v[3, 0, 0] = 1.0, -(big**2), big**2
        expected = {0: 0.0}
    key_cache = torch.zeros(keys // block_size, block_size, 1, head_dim, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    kernels.write_kv(k.bfloat16(), v.bfloat16(), key_cache, value_cache, torch.arange(keys))
    out = kernels.paged_decode_attention(q.bfloat16(), key_cache, value_cache, torch.arange(keys // block_size)[None],
                                         torch.tensor([keys]), 1.0, portable=path == "portable")
    for d, value in expected.items():
        assert out[0, 0, d].item() == value, (case, path, out[0, 0, d].item())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_backend_gives_a_row_the_same_bits_in_any_step(kernels, dtype):
    """Through the attention backend as the runner calls it: a sequence's last prompt token as
    a one-token step (decode kernel) or as the end of a longer chunk (prefill kernel), alone or
    beside other sequences."""
    from kvflow.layers.attention import AttentionMetadata, CPUAttentionBackend

    backend = CPUAttentionBackend()
    heads, kv_heads, head_dim, block_size, seq_len = 9, 3, 64, 16, 40
    key_cache, value_cache, table = _pool(kernels, dtype, seq_len, kv_heads, head_dim, block_size, seed=3)
    kv_cache = torch.stack([key_cache, value_cache])
    g = torch.Generator().manual_seed(11)
    q = torch.randn(seq_len, heads, head_dim, generator=g).to(dtype)
    keys = kv_layout.keys_token_major(key_cache).reshape(-1, kv_heads, head_dim)
    values = value_cache.reshape(-1, kv_heads, head_dim)
    positions = torch.arange(seq_len)
    slots = table[positions // block_size] * block_size + positions % block_size
    k, v = keys[slots], values[slots]  # writing them again leaves the pool as it is

    def step(n_new: int, others: int) -> torch.Tensor:
        """The last n_new tokens as this step's chunk, after `others` unrelated decodes of the same sequence."""
        context = seq_len - n_new
        lens = [s for s in range(seq_len - others, seq_len)] + [seq_len]
        news = [1] * others + [n_new]
        query_start = [0]
        for n in news:
            query_start.append(query_start[-1] + n)
        rows = list(range(seq_len - others - 1, seq_len - 1)) + list(range(context, seq_len))
        meta = AttentionMetadata(
            slot_mapping=slots[rows], query_start_loc=query_start, seq_lens=lens,
            block_tables=table[None].expand(len(lens), -1).contiguous(),
            num_decodes=others + (1 if n_new == 1 else 0), block_size=block_size)
        out = backend.forward(q[rows], k[rows], v[rows], kv_cache, meta, head_dim**-0.5)
        return out[-1]

    reference = step(seq_len, 0)
    for n_new, others in [(1, 0), (1, 5), (2, 0), (17, 3), (seq_len, 8)]:
        assert torch.equal(step(n_new, others), reference), f"chunk of {n_new} beside {others} decodes differs"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_short_chunks_take_the_decode_kernel_with_the_same_bits(impl, dtype):
    """csrc/short_chunks.cpp sends chunks of <= 8 tokens (a speculative verify, a draft's
    catch-up) through the decode kernel, one row per token: in a batch that mixes them with
    long chunks, every row must equal the packed prefill kernel's row (routing forced off)."""
    kernels = impl
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    chunks = [4, 40, 1, 8, 9, 2, 33]  # short, long, short, the threshold, just above, ...
    contexts = [83, 0, 17, 64, 5, 120, 30]
    g = torch.Generator().manual_seed(5)
    pools, tables = [], []
    total_blocks = 0
    for n, c in zip(chunks, contexts):
        blocks = -(-(n + c) // block_size)
        tables.append(list(range(total_blocks, total_blocks + blocks)))
        total_blocks += blocks
    key_cache = torch.full((total_blocks + 1, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    for n, c, table in zip(chunks, contexts, tables):
        pos = torch.arange(n + c)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        kernels.write_kv(torch.randn(n + c, kv_heads, head_dim, generator=g).to(dtype),
                         torch.randn(n + c, kv_heads, head_dim, generator=g).to(dtype), key_cache, value_cache, slots)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    query_start = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int64)
    seq_lens = torch.tensor([n + c for n, c in zip(chunks, contexts)], dtype=torch.int64)
    q = torch.randn(sum(chunks), heads, head_dim, generator=g).to(dtype)

    def run(short_chunk: int) -> torch.Tensor:
        previous = kernels.lib.kvflow_prefill_short_chunk(short_chunk)
        try:
            out = torch.full_like(q, float("nan"))
            kernels.paged_prefill_attention(q, key_cache, value_cache, block_tables, query_start, seq_lens, out,
                                            head_dim**-0.5)
            return out
        finally:
            kernels.lib.kvflow_prefill_short_chunk(previous)

    packed, routed = run(0), run(8)
    assert not torch.isnan(packed).any() and not torch.isnan(routed).any()
    bad = [t for t in range(q.shape[0]) if not torch.equal(packed[t], routed[t])]
    assert not bad, f"rows {bad[:10]} differ between the decode route and the packed prefill kernel"
    # Every row of a routed chunk must match the row computed as a lone decode too.
    for s in (0, 2, 5):
        lens = seq_lens[s] - chunks[s] + torch.arange(1, chunks[s] + 1)
        rows = q[query_start[s]:query_start[s + 1]].contiguous()
        alone = kernels.paged_decode_attention(rows, key_cache, value_cache,
                                               block_tables[s:s + 1].expand(chunks[s], -1).contiguous(), lens,
                                               head_dim**-0.5)
        assert torch.equal(alone, routed[query_start[s]:query_start[s + 1]])
