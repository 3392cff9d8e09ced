"""kvflow's compiled CPU kernels (kvflow/csrc) against float64 references computed from the math.

Guards:
  - the kernels build (a missing compiler or broken build fails here, it never skips);
  - paged decode attention, both the AVX-512 and the portable loops, in float32 and bfloat16,
    over GQA group sizes, head dims (including one that is not a multiple of 16), block sizes,
    sequence lengths at and across block boundaries, shuffled block tables, and both work splits
    (per KV head for few sequences, whole sequences for many); NaN-filled blocks behind the padding
    entries of the tables, and in the unused tail slots of each last block, prove that only a
    sequence's own tokens are read;
  - every source compiles for CPUs other than this one (tests/layers/test_gemm.py has the GEMMs).
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvflow.layers import cpu_build, cpu_kernels, kv_layout


def test_load_builds_the_kernels(kernels):
    assert kernels.path.exists()
    assert kernels.max_group >= 16 and kernels.max_head_dim >= 128
    assert kernels.supports(torch.float32, 32, 8, 128)
    assert kernels.supports(torch.bfloat16, 12, 4, 64)
    assert not kernels.supports(torch.float16, 8, 8, 64)
    assert not kernels.supports(torch.float32, 6, 4, 64)  # heads not a multiple of KV heads
    assert not kernels.supports(torch.float32, 8 * (kernels.max_group + 1), 8, 64)
    assert not kernels.supports(torch.float32, 8, 8, kernels.max_head_dim + 16)


def test_kernels_can_be_disabled(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_KERNELS", "0")
    assert cpu_kernels.load.__wrapped__() is None  # bypass the cache of the real load()


# ---- paged decode attention -------------------------------------------------------------


def make_paged_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """q, K/V caches (keys in the pool's stored layout, `kv_layout`), a shuffled block table with
    NaN-block padding, and seq_lens.

    Every block a sequence owns comes from a random permutation of the pool; each table row is
    padded with two entries pointing at NaN blocks, and the slots past a sequence's length in its
    last block are NaN too, so reading anything but the sequence's own tokens poisons the output.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_valid = sum(blocks_per_seq)
    num_nan = 3
    perm = torch.randperm(num_valid + num_nan, generator=g)
    valid_ids, nan_ids = perm[:num_valid], perm[num_valid:]

    shape = (num_valid + num_nan, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g)
    value_cache = torch.randn(shape, generator=g)
    key_cache[nan_ids] = float("nan")
    value_cache[nan_ids] = float("nan")

    width = max(blocks_per_seq) + 2
    tables = torch.empty((len(seq_lens), width), dtype=torch.int64)
    start = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        own = valid_ids[start : start + nb]
        start += nb
        tables[s, :nb] = own
        tables[s, nb:] = nan_ids[torch.randint(num_nan, (width - nb,), generator=g)]
        used_in_last = n - (nb - 1) * block_size
        key_cache[own[-1], used_in_last:] = float("nan")
        value_cache[own[-1], used_in_last:] = float("nan")

    # A spread of score magnitudes, so the softmax is neither uniform nor one-hot.
    q = 2.0 * torch.randn((len(seq_lens), num_heads, head_dim), generator=g)
    return (
        q.to(dtype),
        kv_layout.key_cache_from_token_major(key_cache.to(dtype)),
        value_cache.to(dtype),
        tables,
        torch.tensor(seq_lens, dtype=torch.int64),
    )


def reference_decode(q, key_cache, value_cache, tables, seq_lens, scale):
    """float64: gather each sequence's tokens through its table, softmax(q k^T * scale) v.

    All sequences at once, padded to the longest and masked (one batched matmul instead of one per
    sequence: small float64 matmuls are slow with intra-op threads on a busy machine).
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    pos = torch.arange(int(seq_lens.max()))
    valid = pos[None, :] < seq_lens[:, None]  # [S, L]
    block = torch.gather(tables, 1, (pos // block_size).clamp(max=tables.shape[1] - 1).expand(num_seqs, -1))
    slots = torch.where(valid, block * block_size + pos % block_size, 0)

    def gather(cache):  # [S, KVH, L, D], zero past each sequence's length
        rows = cache.reshape(-1, num_kv_heads, head_dim)[slots].double()
        return torch.where(valid[:, :, None, None], rows, 0.0).transpose(1, 2)

    k, v = gather(kv_layout.keys_token_major(key_cache)), gather(value_cache)
    qg = q.double().view(num_seqs, num_kv_heads, group, head_dim)  # query head h uses KV head h // group
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [S, KVH, group, L]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).reshape(num_seqs, num_heads, head_dim)


def assert_matches_reference(out, ref, dtype):
    assert not torch.isnan(out).any(), "NaN in the output: the kernel read a slot outside a sequence's tokens"
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:
        # The kernel accumulates in float32 and rounds once; compare with the rounded reference.
        torch.testing.assert_close(out.double(), ref.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)


# (num_heads, num_kv_heads, head_dim, block_size)
SHAPES = [
    pytest.param(4, 4, 64, 16, id="g1-d64-b16"),
    pytest.param(6, 2, 128, 16, id="g3-d128-b16"),
    pytest.param(8, 2, 64, 32, id="g4-d64-b32"),
    pytest.param(8, 2, 128, 1, id="g4-d128-b1"),  # block sizes below 16: keys gathered across blocks
    pytest.param(6, 2, 64, 24, id="g3-d64-b24"),
    pytest.param(6, 2, 40, 16, id="g3-d40-b16"),  # head_dim % 16 != 0: portable loops even when asked for AVX-512
    pytest.param(32, 2, 64, 16, id="g16-d64-b16"),  # the largest group the kernel takes
    pytest.param(72, 8, 32, 16, id="g9-h72-d32-b16"),  # many heads in one whole-sequence item
    pytest.param(4, 1, 48, 16, id="g4-d48-b16"),  # an odd number of 16-lane vectors: bf16 p.V takes float32 FMAs
    pytest.param(2, 1, 256, 8, id="g2-d256-b8"),  # the largest head_dim, one row per register block
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
PATHS = [pytest.param(False, id="avx512"), pytest.param(True, id="portable")]


def batch_lens(kind: str, block_size: int, seed: int) -> list[int]:
    if kind == "one":
        return [3 * block_size + 5]
    if kind == "edges":  # length 1, exactly at a block boundary, just past one, across several
        return [1, block_size, block_size + 1, 2 * block_size + block_size // 2 + 1, 3 * block_size]
    # Enough sequences that the kernel switches to whole-sequence items whatever the thread count.
    g = torch.Generator().manual_seed(seed)
    n = max(40, 4 * torch.get_num_threads() + 1)
    return torch.randint(1, 3 * block_size + 6, (n,), generator=g).tolist()


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", SHAPES)
@pytest.mark.parametrize("kind", ["one", "edges", "many"])
def test_paged_decode_attention_matches_reference(kernels, kind, num_heads, num_kv_heads, head_dim, block_size,
                                                  dtype, portable):
    torch.manual_seed(0)
    lens = batch_lens(kind, block_size, seed=head_dim + block_size)
    q, kc, vc, tables, seq_lens = make_paged_case(lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                                  seed=num_heads * 1000 + head_dim)
    scale = head_dim**-0.5
    out = kernels.paged_decode_attention(q, kc, vc, tables, seq_lens, scale, portable=portable)
    assert out.shape == q.shape and out.dtype == dtype
    assert_matches_reference(out, reference_decode(q, kc, vc, tables, seq_lens, scale), dtype)
    # The "avx512" cases must really run it wherever AVX-512 is there, whatever the block size.
    assert kernels.decode_fast_path(dtype, head_dim) == (kernels.avx512f and head_dim % 16 == 0)


def test_paged_decode_attention_long_sequence(kernels):
    """A context of several hundred tokens: softmax max/sum over many 16-lane chunks plus a tail."""
    lens = [517, 1, 300]
    q, kc, vc, tables, seq_lens = make_paged_case(lens, 8, 2, 64, 16, torch.float32, seed=7)
    ref = reference_decode(q, kc, vc, tables, seq_lens, 0.125)
    for portable in (False, True):
        out = kernels.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125, portable=portable)
        assert_matches_reference(out, ref, torch.float32)


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_is_batch_invariant(kernels, dtype, portable):
    """A sequence's output is bitwise the same alone (per-KV-head items) or in a large batch
    (whole-sequence items): the work split changes, the arithmetic per head must not."""
    lens = batch_lens("many", 16, seed=5)
    q, kc, vc, tables, seq_lens = make_paged_case(lens, 8, 2, 64, 16, dtype, seed=5)
    batched = kernels.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125, portable=portable)
    for s in (0, 1, len(lens) // 2, len(lens) - 1):
        alone = kernels.paged_decode_attention(q[s : s + 1], kc, vc, tables[s : s + 1], seq_lens[s : s + 1], 0.125,
                                               portable=portable)
        assert torch.equal(alone[0], batched[s]), f"sequence {s} differs alone vs batched"


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["few", "many"])  # per-KV-head and whole-sequence work items
def test_paged_decode_attention_takes_row_strided_q(kernels, kind, dtype, portable):
    """q as a view into a fused QKV output (rows wider than the heads) reads the right rows."""
    lens = [5, 40, 17] if kind == "few" else batch_lens("many", 16, seed=3)
    q, kc, vc, tables, seq_lens = make_paged_case(lens, 8, 2, 64, 16, dtype, seed=3)
    wide = torch.full((q.shape[0], q.shape[1] * q.shape[2] + 96), float("nan"), dtype=dtype)
    wide[:, : q.shape[1] * q.shape[2]] = q.reshape(q.shape[0], -1)
    view = wide[:, : q.shape[1] * q.shape[2]].view(q.shape)
    assert not view.is_contiguous()
    out = kernels.paged_decode_attention(view, kc, vc, tables, seq_lens, 0.125, portable=portable)
    assert torch.equal(out, kernels.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125, portable=portable))


def test_paged_decode_attention_rejects_bad_inputs(kernels):
    q, kc, vc, tables, seq_lens = make_paged_case([5, 9], 4, 2, 64, 4, torch.float32)
    with pytest.raises(ValueError, match="unsupported shape"):  # group beyond the kernel's maximum
        big_q = torch.randn(2, 2 * (kernels.max_group + 1), 64)
        kernels.paged_decode_attention(big_q, kc, vc, tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="contiguous heads"):
        kernels.paged_decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_decode_attention(q, kc, vc, tables.int(), seq_lens, 0.125)


@pytest.mark.parametrize("march", ["x86-64-v2", "skylake-avx512", "sapphirerapids"])
def test_kernel_sources_compile_for_other_cpus(march):
    """`make` compiles for the machine it runs on (-march=native), so this machine's build says
    nothing about others: each source must also compile for a CPU without AVX-512, one with
    AVX-512 but no AVX512-BF16, and one with both (a failure there disables every kernel)."""
    cxx = cpu_build._compiler()
    assert cxx is not None, "no C++ compiler: make needs one to install kvflow"
    def check(source):
        return source, subprocess.run([cxx, "-std=c++17", "-fopenmp", f"-march={march}", "-fsyntax-only", str(source)],
                                      capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:  # one compiler per core
        for source, result in pool.map(check, cpu_build._SOURCES):
            assert result.returncode == 0, f"{source.name} for -march={march}:\n{result.stderr[-2000:]}"


def test_decode_fast_path_on_avx512_without_bf16(kernels, tmp_path):
    """Skylake to Ice Lake servers have AVX-512 but not AVX512-BF16. There float32 decode runs its
    AVX-512 path, and bf16 decode the portable reference (csrc/attention_ref.h): its numerics pair
    keys as vdpbf16ps does, which only AVX512-BF16 computes natively (docs/architecture.md,
    "Attention numerics"). Built here for such a CPU (this one runs its code) and checked against
    the reference in both dtypes."""
    if not kernels.avx512f:
        pytest.skip("this CPU has no AVX-512: it cannot run code built for skylake-avx512")
    cxx = cpu_build._compiler()
    assert cxx is not None, "no C++ compiler: make needs one to install kvflow"
    lib = tmp_path / "kvflow_skylake.so"
    flags = [f for f in cpu_build._FLAGS if not f.startswith("-march")] + ["-march=skylake-avx512"]
    cpu_build.compile_library(cxx, flags, lib)
    skylake = cpu_kernels.CPUKernels(lib, amx="off")  # a build without AMX
    assert skylake.avx512f and not skylake.avx512_bf16 and skylake.has_gemm_bf16  # bf16 GEMM: AVX2
    assert skylake.decode_fast_path(torch.float32, 64) and not skylake.decode_fast_path(torch.bfloat16, 64)
    for dtype in (torch.bfloat16, torch.float32):
        for block_size in (16, 8):
            lens = batch_lens("edges", block_size, seed=block_size)
            q, kc, vc, tables, seq_lens = make_paged_case(lens, 6, 2, 64, block_size, dtype, seed=block_size)
            out = skylake.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
            assert_matches_reference(out, reference_decode(q, kc, vc, tables, seq_lens, 0.125), dtype)


def test_build_jobs_setting(monkeypatch):
    """KVFLOW_BUILD_JOBS caps how many compilers run at once (each takes a few hundred MB);
    anything but a positive whole number is refused with the setting's name."""
    monkeypatch.setenv("KVFLOW_BUILD_JOBS", "3")
    assert cpu_build._build_jobs() == 3
    monkeypatch.delenv("KVFLOW_BUILD_JOBS")
    assert cpu_build._build_jobs() == len(os.sched_getaffinity(0))
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("KVFLOW_BUILD_JOBS", bad)
        with pytest.raises(ValueError, match="KVFLOW_BUILD_JOBS"):
            cpu_build._build_jobs()
