"""The two ways the bf16 GEMM and prefill-attention blocks multiply (csrc/dpbf16.h): vdpbf16ps, or
two float32 FMAs per k-pair under DAZ/FTZ, which `set_bf16_dot` picks per CPU. They must give the
same bits for every row count, denormals included, or a token's output would depend on the CPU
type's choice of instruction (and on the row count: GEMM blocks under 4 rows keep vdpbf16ps,
where prefill attention's FMA path runs every block with FMAs).
"""

from __future__ import annotations

import pytest
import torch

from tests.layers.test_prefill_attention import CHUNKS, build_step, write_new_kv


@pytest.fixture
def modes(kernels):
    if not kernels.has_gemm(torch.bfloat16):
        pytest.skip("this CPU has no bf16 GEMM (neither AVX512-BF16 nor AVX2 + FMA)")
    before = kernels.bf16_dot
    if kernels.set_bf16_dot("fma") != "fma" or kernels.set_bf16_dot("dpbf16") != "dpbf16":
        kernels.set_bf16_dot(before)
        pytest.skip("this build has one way to multiply bf16 (no AVX512-BF16: the AVX2 blocks' FMAs)")
    yield kernels
    kernels.set_bf16_dot(before)


def run_in(kernels, mode: str, fn):
    assert kernels.set_bf16_dot(mode) == mode
    return fn()


def with_denormals(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Some entries replaced by denormal bf16 values (vdpbf16ps reads them as zero)."""
    t = t.clone()
    flat = t.view(-1)
    picks = torch.randperm(flat.numel(), generator=g)[: max(2, flat.numel() // 50)]
    flat[picks] = torch.tensor(3e-39).to(t.dtype) * torch.sign(torch.randn(len(picks), generator=g)).to(t.dtype)
    return t


@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 12, 13, 64, 70, 300])
@pytest.mark.parametrize("n, k", [(40, 64), (200, 576)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fma_block_gives_the_vdpbf16ps_bits(modes, m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = with_denormals(torch.randn(m, k, generator=g).bfloat16(), g)
    w = with_denormals((torch.randn(n, k, generator=g) / k**0.5).bfloat16(), g)
    # Row 0 x column 0: every product 1e-38 underflows, and vdpbf16ps flushes each partial sum to
    # zero; unflushed they would add up to a normal number (k * 1e-38) that survives into bf16.
    x[0, :] = 1e-19
    w[0, :] = 1e-19
    # Row m-1 x column 1: one denormal input against zeros, read as zero by vdpbf16ps.
    x[m - 1, :] = 0.0
    x[m - 1, 0] = 1e-39
    w[1, :] = 0.0
    w[1, 0] = 1e30
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    packed = modes.pack_weight(w)
    dp = run_in(modes, "dpbf16", lambda: modes.gemm(x, packed, n, bias))
    fma = run_in(modes, "fma", lambda: modes.gemm(x, packed, n, bias))
    assert torch.equal(dp.view(torch.int16), fma.view(torch.int16))
    if not with_bias:
        assert dp[0, 0] == 0 and dp[m - 1, 1] == 0  # flushed, as vdpbf16ps does
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    exact[0, 0], exact[m - 1, 1] = (0.0, 0.0) if bias is None else (bias[0].double(), bias[1].double())
    torch.testing.assert_close(fma.double(), exact, rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 64), (3, 1, 80), (4, 4, 32)])
def test_prefill_attention_gives_the_same_bits_either_way(modes, heads, kv_heads, head_dim):
    """With FMAs, prefill attention runs its own loop (queries widened once per head, probabilities
    kept in float32, blocks of two tiles): head_dim 80 leaves a tile over; denormal queries, keys
    and values are read as zero either way."""
    step = build_step(CHUNKS, heads, kv_heads, head_dim, 16, seed=11, dtype=torch.bfloat16)
    cache, meta = write_new_kv(step), step.meta
    g = torch.Generator().manual_seed(head_dim)
    q = with_denormals(step.q, g)
    cache = with_denormals(cache, g)

    def attend():
        out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
        modes.paged_prefill_attention(q, cache[0], cache[1], meta.block_tables, meta.query_start_tensor,
                                      meta.seq_lens_tensor, out, 0.125)
        return out

    dp, fma = run_in(modes, "dpbf16", attend), run_in(modes, "fma", attend)
    assert not dp.isnan().any() and torch.equal(dp.view(torch.int16), fma.view(torch.int16))


def test_choice_is_checked(modes):
    assert modes.set_bf16_dot("auto") in ("dpbf16", "fma")
    assert modes.set_bf16_dot("dpbf16") == modes.bf16_dot == "dpbf16"
    with pytest.raises(ValueError, match="KVFLOW_BF16_DOT"):
        modes.set_bf16_dot("amx")


def test_without_avx512_bf16_the_label_says_fma(kernels):
    """Benchmarks print this label with every figure: on AVX2 hosts the blocks multiply with FMAs,
    whatever is asked."""
    if kernels.avx512_bf16:
        pytest.skip("this CPU has AVX512-BF16: both ways are compiled (test_choice_is_checked)")
    before = kernels.bf16_dot
    assert kernels.set_bf16_dot("dpbf16") == kernels.bf16_dot == ("fma" if kernels.has_gemm_bf16 else "none")
    assert before == kernels.bf16_dot
