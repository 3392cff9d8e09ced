"""The paged prefill attention kernel (csrc/prefill_attention.cpp) against a float64 reference,
in bf16 and float32.

Guards:
  - `supports_prefill`: wherever the decode kernel runs (the AVX-512 path, or the portable
    reference of the same numerics on other CPUs and head sizes), head_dim up to 256;
  - causal attention of each chunk over everything its sequence has cached so far: query i of a
    chunk at absolute position context + i sees keys 0..context + i. Several chunks per call: fresh
    prompts (context 0) of 1, 17, 100 and 300 tokens, and chunks over cached context (37 after 50,
    70 after 17, 1 after 200), for GQA group sizes 1, 3, 4, head_dim 64 and 128 and block sizes 1,
    16 and 32, through shuffled block tables; every pool slot no sequence owns is NaN, as is the
    padding of each table row, and no NaN may reach the output;
  - in bf16 the kernel rounds probabilities to bf16, so it is compared with a 2e-2 absolute
    tolerance on unit-variance inputs (float32: 1e-4), and must be about as accurate as the
    PyTorch path (within a factor 2);
  - through `CPUAttentionBackend(use_kernels=True).forward` on a mixed step (decodes first, then
    prefill chunks) with q/k/v as row-strided views of one fused QKV tensor: decode and prefill
    rows both match the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvflow.layers import cpu_kernels, kv_layout
from kvflow.layers.attention import AttentionMetadata, CPUAttentionBackend


BF16, F32 = torch.bfloat16, torch.float32
DTYPES = pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
ATOL = {BF16: 2e-2, F32: 1e-4}
# (tokens already cached, new tokens this step), one entry per sequence.
CHUNKS = [(0, 1), (0, 17), (0, 100), (0, 300), (50, 37), (17, 70), (200, 1)]




@pytest.fixture
def prefill(kernels, dtype) -> cpu_kernels.CPUKernels:
    if not kernels.supports_prefill(dtype, 4, 2, 64):
        pytest.skip(f"this CPU lacks the instructions of kvflow's {dtype} prefill attention")
    return kernels


@dataclass
class Step:
    qkv: torch.Tensor  # [T, (H + 2 KVH) * D]: q, k, v are row-strided views into it
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, blocks, block_size, KVH, D]: cached context written, NaN elsewhere
    meta: AttentionMetadata
    full_k: list[torch.Tensor]  # per sequence, every key it can see: [context + new, KVH, D]
    full_v: list[torch.Tensor]


def build_step(chunks, num_heads, num_kv_heads, head_dim, block_size, num_decodes=0, seed=0, dtype=BF16) -> Step:
    """A step over `chunks` in a NaN-filled pool with shuffled block tables (as the model runner
    builds it: slot of token t = table[t // block_size] * block_size + t % block_size)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in chunks]
    owned = [-(-n // block_size) for n in seq_lens]
    num_nan = 2  # blocks nobody owns: the padding of every table row points there
    perm = torch.randperm(sum(owned) + num_nan, generator=g)
    width = max(owned) + 1
    tables = perm[-1].repeat(len(chunks), width).clone()
    start = 0
    for s, n in enumerate(owned):
        tables[s, :n] = perm[start : start + n]
        start += n
    kv_cache = torch.full((2, sum(owned) + num_nan, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)

    def slots(s: int, positions) -> torch.Tensor:
        pos = torch.as_tensor(list(positions), dtype=torch.int64)
        return tables[s, pos // block_size] * block_size + pos % block_size

    total = sum(new for _, new in chunks)
    qkv = torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(total, num_heads, head_dim)
    k, v = k.view(total, num_kv_heads, head_dim), v.view(total, num_kv_heads, head_dim)

    full_k, full_v, query_start, slot_mapping = [], [], [0], []
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    for s, (cached, new) in enumerate(chunks):
        a = query_start[-1]
        query_start.append(a + new)
        ck = torch.randn(cached, num_kv_heads, head_dim, generator=g).to(dtype)
        cv = torch.randn(cached, num_kv_heads, head_dim, generator=g).to(dtype)
        kv_layout.write_keys(kv_cache[0], slots(s, range(cached)), ck)
        flat[1, slots(s, range(cached))] = cv
        full_k.append(torch.cat([ck, k[a : a + new]]))
        full_v.append(torch.cat([cv, v[a : a + new]]))
        slot_mapping.append(slots(s, range(cached, cached + new)))

    lens = torch.tensor(seq_lens, dtype=torch.int64)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping), query_start_loc=query_start, seq_lens=seq_lens, block_tables=tables,
        num_decodes=num_decodes, block_size=block_size,
        query_start_tensor=torch.tensor(query_start, dtype=torch.int64), seq_lens_tensor=lens)
    return Step(qkv, q, k, v, kv_cache, meta, full_k, full_v)


def write_new_kv(step: Step) -> torch.Tensor:
    """The pool with this step's K/V written, as the backend does before attending."""
    cache = step.kv_cache.clone()
    num_kv_heads, head_dim = step.k.shape[1:]
    kv_layout.write_keys(cache[0], step.meta.slot_mapping, step.k)
    cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, step.meta.slot_mapping, step.v)
    return cache


def reference(step: Step, scale: float) -> torch.Tensor:
    """float64 causal attention, straight from the math: query i of a chunk after `context` cached
    tokens sees keys 0..context + i."""
    num_heads = step.q.shape[1]
    out = torch.empty(step.q.shape, dtype=torch.float64)
    qsl = step.meta.query_start_loc
    for s in range(step.meta.num_seqs):
        a, b = qsl[s], qsl[s + 1]
        keys, values = step.full_k[s].double(), step.full_v[s].double()
        group = num_heads // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        n, total = b - a, keys.shape[0]
        scores = torch.einsum("qhd,khd->hqk", step.q[a:b].double(), keys) * scale
        scores.masked_fill_(torch.arange(total)[None, :] > torch.arange(n)[:, None] + (total - n), float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)
    return out


def test_supports_prefill(kernels):
    """The prefill kernel takes what the decode kernel takes: its AVX-512 path where the CPU has
    it and head_dim is a multiple of 16, the portable reference (csrc/attention_ref.h) elsewhere."""
    for shape in [(BF16, 12, 4, 64), (BF16, 8, 8, 128), (BF16, 8, 2, 256), (F32, 8, 2, 64), (BF16, 6, 2, 40)]:
        assert kernels.supports_prefill(*shape)
    assert not kernels.supports_prefill(torch.float16, 8, 2, 64)
    assert not kernels.supports_prefill(BF16, 6, 2, 272)  # beyond 256
    assert not kernels.supports_prefill(BF16, 6, 4, 64)  # heads not a multiple of KV heads


# (num_heads, num_kv_heads, head_dim, block_size)
SHAPES = [
    pytest.param(4, 4, 64, 16, id="g1-d64-b16"),
    pytest.param(6, 2, 128, 32, id="g3-d128-b32"),
    pytest.param(8, 2, 64, 1, id="g4-d64-b1"),
    pytest.param(4, 1, 128, 16, id="g4-d128-b16"),
    pytest.param(3, 1, 64, 32, id="g3-d64-b32"),
    pytest.param(6, 2, 40, 16, id="g3-d40-b16"),  # not a multiple of 16: the portable path everywhere
]


@DTYPES
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", SHAPES)
def test_paged_prefill_attention_matches_reference(prefill, dtype, num_heads, num_kv_heads, head_dim, block_size):
    step = build_step(CHUNKS, num_heads, num_kv_heads, head_dim, block_size, seed=head_dim + block_size, dtype=dtype)
    scale = head_dim**-0.5
    cache = write_new_kv(step)
    meta = step.meta
    out = torch.full(step.q.shape, float("nan"), dtype=dtype)
    prefill.paged_prefill_attention(step.q, cache[0], cache[1], meta.block_tables, meta.query_start_tensor,
                                    meta.seq_lens_tensor, out, scale)  # q as a row-strided view
    assert not torch.isnan(out).any(), "NaN in the output: a row was not written, or an unowned slot was read"
    ref = reference(step, scale)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=ATOL[dtype])

    # About as accurate as the PyTorch path (SDPA for fresh prompts, float32 scores over context).
    torch_out = CPUAttentionBackend(use_kernels=False).forward(step.q, step.k, step.v, step.kv_cache.clone(), meta, scale)
    kernel_err, torch_err = (out.double() - ref).abs(), (torch_out.double() - ref).abs()
    assert kernel_err.max() <= 2 * torch_err.max(), (kernel_err.max().item(), torch_err.max().item())
    assert kernel_err.mean() <= 2 * torch_err.mean(), (kernel_err.mean().item(), torch_err.mean().item())
    # A sequence's rows depend only on that sequence: the same chunk alone gives the same bits.
    s = 4  # the chunk of 37 over 50 cached tokens
    a, b = meta.query_start_loc[s], meta.query_start_loc[s + 1]
    alone = torch.full((b - a, num_heads, head_dim), float("nan"), dtype=dtype)
    prefill.paged_prefill_attention(step.q[a:b], cache[0], cache[1], meta.block_tables[s : s + 1].contiguous(),
                                    torch.tensor([0, b - a]), meta.seq_lens_tensor[s : s + 1], alone, scale)
    assert torch.equal(alone, out[a:b])


@DTYPES
def test_packing_in_rounds_changes_nothing(prefill, dtype):
    """With a pack budget too small for two (sequence, KV head) pairs, each pair is packed and
    attended in its own round: the output must be bit for bit the one-round output."""
    if not (prefill.avx512_bf16 if dtype == torch.bfloat16 else prefill.avx512f):
        pytest.skip(f"this CPU lacks the AVX-512 path of {dtype} prefill attention, which packs K/V")
    step = build_step(CHUNKS, 6, 2, 64, 16, seed=5, dtype=dtype)
    cache, meta = write_new_kv(step), step.meta
    args = (cache[0], cache[1], meta.block_tables, meta.query_start_tensor, meta.seq_lens_tensor)
    one_round = torch.full(step.q.shape, float("nan"), dtype=dtype)
    prefill.paged_prefill_attention(step.q, *args, one_round, 0.125)
    previous = prefill.lib.kvflow_prefill_pack_budget(1)
    try:
        rounds = torch.full(step.q.shape, float("nan"), dtype=dtype)
        prefill.paged_prefill_attention(step.q, *args, rounds, 0.125)
    finally:
        prefill.lib.kvflow_prefill_pack_budget(previous)
    assert previous == 64 << 20
    assert not rounds.isnan().any() and torch.equal(rounds, one_round)


@pytest.mark.parametrize("dtype", [BF16], ids=["bf16"])
def test_paged_prefill_attention_rejects_bad_inputs(prefill, dtype):
    step = build_step([(3, 5)], 4, 2, 64, 4)
    cache, meta = write_new_kv(step), step.meta
    out = torch.empty(step.q.shape, dtype=BF16)
    args = (cache[0], cache[1], meta.block_tables, meta.query_start_tensor, meta.seq_lens_tensor)
    with pytest.raises(ValueError, match="share one dtype"):  # float32 q and out over bf16 caches
        prefill.paged_prefill_attention(step.q.float(), *args, out.float(), 0.125)
    with pytest.raises(ValueError, match="share one dtype"):
        prefill.paged_prefill_attention(step.q.half(), cache[0].half(), cache[1].half(), *args[2:], out.half(), 0.125)
    with pytest.raises(ValueError, match="contiguous heads"):
        prefill.paged_prefill_attention(step.q.transpose(0, 1).contiguous().transpose(0, 1), *args, out, 0.125)
    with pytest.raises(ValueError, match="int64"):
        prefill.paged_prefill_attention(step.q, cache[0], cache[1], meta.block_tables.int(), meta.query_start_tensor,
                                        meta.seq_lens_tensor, out, 0.125)



@DTYPES
@pytest.mark.parametrize("block_size", [16, 1])
def test_backend_mixed_step(prefill, dtype, monkeypatch, block_size):
    """Decodes then prefill chunks through the kernel backend, q/k/v as views of a fused QKV."""
    chunks = [(20, 1), (70, 1), (0, 100), (50, 37), (0, 33), (17, 300)]
    num_heads, num_kv_heads, head_dim, scale = 9, 3, 64, 0.125
    step = build_step(chunks, num_heads, num_kv_heads, head_dim, block_size, num_decodes=2, seed=block_size,
                      dtype=dtype)
    assert step.q.stride(0) == step.qkv.shape[1] and not step.q.is_contiguous()

    backend = CPUAttentionBackend(use_kernels=True)
    calls = []
    real = backend.kernels.paged_prefill_attention
    monkeypatch.setattr(backend.kernels, "paged_prefill_attention", lambda *a: calls.append(1) or real(*a))
    cache = step.kv_cache.clone()
    out = backend.forward(step.q, step.k, step.v, cache, step.meta, scale)
    assert calls == [1], "the prefill chunks did not go through the kernel"
    assert out.shape == step.q.shape and out.dtype == dtype and not torch.isnan(out).any()
    # The step's K/V landed where mapped (write_kv on views of the fused QKV), nothing else moved.
    torch.testing.assert_close(cache, write_new_kv(step), rtol=0, atol=0, equal_nan=True)

    ref = reference(step, scale)
    nd = step.meta.num_decodes
    torch.testing.assert_close(out[:nd].double(), ref[:nd], rtol=0, atol=ATOL[dtype], msg="decode rows")
    torch.testing.assert_close(out[nd:].double(), ref[nd:], rtol=0, atol=ATOL[dtype], msg="prefill rows")
    torch_out = CPUAttentionBackend(use_kernels=False).forward(step.q, step.k, step.v, step.kv_cache.clone(), step.meta,
                                                               scale)
    assert (out.double() - ref).abs().max() <= 2 * (torch_out.double() - ref).abs().max()


@pytest.mark.parametrize("dtype", [BF16], ids=["bf16"])
def test_backend_falls_back_when_heads_are_not_contiguous(prefill, dtype):
    """Inputs the kernels do not take (heads strided apart) go through the PyTorch path, not an error."""
    step = build_step([(0, 5), (3, 4)], 4, 2, 64, 4)
    heads_apart = lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)  # noqa: E731
    q, k, v = heads_apart(step.q), heads_apart(step.k), heads_apart(step.v)
    with_kernels = CPUAttentionBackend(use_kernels=True).forward(q, k, v, step.kv_cache.clone(), step.meta, 0.125)
    without = CPUAttentionBackend(use_kernels=False).forward(q, k, v, step.kv_cache.clone(), step.meta, 0.125)
    torch.testing.assert_close(with_kernels, without)
