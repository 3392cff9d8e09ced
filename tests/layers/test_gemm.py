"""kvflow's packed GEMMs (csrc/gemm.cpp) against a float64 reference, in bf16 and float32.

Guards, for each dtype (the AVX-512 kernels where the CPU has AVX-512F, and AVX512-BF16 for bf16;
the AVX2 + FMA blocks of csrc/gemm_avx2.h elsewhere):
  - values with and without bias over row counts that split into register blocks of every
    size (up to 12 rows; float32 8 beyond 64 rows), ragged N (a half tile, an odd tile
    count) and two K;
  - the packed layout itself;
  - batch invariance: each row is bitwise the row computed alone, or in any sub-batch;
  - strided rows and a non-contiguous bias give the contiguous result;
  - bad shapes and mixed dtypes raise ValueError rather than reading out of bounds;
  - the AVX2 blocks give the AVX-512 kernels' bits (against the SIMDe-emulated build);
  - all of the above again for bf16 on AMX tiles (csrc/gemm_amx.h) where the CPU has them, whose
    bits differ from the vector blocks' but are just as batch- and thread-count-invariant.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from kvflow.layers import cpu_kernels
from tests.layers.test_bf16_dot import with_denormals

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


@contextlib.contextmanager
def amx_mode(kernels, choice: str):
    """The kernels with `set_amx(choice)` in force, the setting before restored after; "auto"
    skips the test where there are no tiles."""
    before = kernels.amx
    try:
        if not kernels.set_amx(choice) and choice == "auto":
            pytest.skip("no AMX bf16 tiles here (CPU, kernel or build)")
        yield kernels
    finally:
        kernels.set_amx("auto" if before else "off")


def amx_telltale_rows(m: int, k: int) -> torch.Tensor:
    """Rows of (2^24, 1, -2^24, 1, ...) in bf16: against a weight of ones vdpbf16ps's chain of FMAs
    loses every 1 next to 2^24 (sum 0), the tile unit keeps them (sum K/2)."""
    x = torch.ones(m, k)
    x[:, 0::4], x[:, 2::4] = 2.0**24, -(2.0**24)
    return x.to(torch.bfloat16)


@pytest.fixture(params=["vector", "amx"])
def gemm(kernels, dtype, request):
    """The kernels with the bf16 GEMM on the vector blocks, then on AMX tiles where there are any."""
    if not kernels.has_gemm(dtype):
        pytest.skip(f"this CPU lacks the instructions of kvflow's {dtype} GEMM")
    if request.param == "amx" and dtype != torch.bfloat16:
        pytest.skip("AMX tiles run the bf16 GEMM only")
    with amx_mode(kernels, "auto" if request.param == "amx" else "off"):
        yield kernels


def randn(*shape, dtype, generator=None):
    return torch.randn(*shape, generator=generator).to(dtype)


def reference_linear(x, w, bias):
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def assert_close_to_exact(y, ref, dtype):
    """Within a rounding of the output dtype from the exact product (float32 accumulation adds
    far less than the tolerances)."""
    assert y.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-3)
    else:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@DTYPES
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k", [64, 576])
@pytest.mark.parametrize("n", [16, 40, 64, 200])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 12, 13, 17, 64, 70])
def test_gemm_matches_reference(gemm, dtype, m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 100_000 + n * 1000 + k)
    x, w = randn(m, k, dtype=dtype, generator=g), randn(n, k, dtype=dtype, generator=g) / math.sqrt(k)
    bias = randn(n, dtype=dtype, generator=g) if with_bias else None
    packed = gemm.pack_weight(w)
    expected_shape = (-(-n // 16), k // 2, 16, 2) if dtype == torch.bfloat16 else (-(-n // 16), k, 16)
    assert packed.shape == expected_shape and packed.dtype == dtype
    y = gemm.gemm(x, packed, n, bias)
    assert y.shape == (m, n)
    assert_close_to_exact(y, reference_linear(x, w, bias), dtype)


@DTYPES
def test_pack_weight_layout(gemm, dtype):
    """bf16 [ceil(N/16), K/2, 16, 2]: tile, k-pair, column in tile, k within pair;
    float32 [ceil(N/16), K, 16]: tile, k, column in tile. Columns past N are zero."""
    n, k = 20, 6
    w = torch.arange(n * k, dtype=torch.float32).view(n, k).to(dtype)
    packed = gemm.pack_weight(w)
    for col in range(32):
        for kk in range(k):
            expected = w[col, kk] if col < n else 0
            got = packed[col // 16, kk // 2, col % 16, kk % 2] if dtype == torch.bfloat16 else packed[col // 16, kk, col % 16]
            assert got == expected, (col, kk)


@DTYPES
def test_gemm_is_batch_invariant(gemm, dtype):
    """Each row of a 70-row product (bf16: blocks of 12 and 11 rows; float32: 8 and 7) is bitwise
    the row computed alone, and any sub-batch (17 rows: blocks of 9 and 8; 12 rows: one block)
    gives the same rows."""
    torch.manual_seed(0)
    m, n, k = 70, 200, 576
    x, w, bias = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype) / math.sqrt(k), randn(n, dtype=dtype)
    packed = gemm.pack_weight(w)
    for b in (None, bias):
        batched = gemm.gemm(x, packed, n, b)
        for i in range(m):
            alone = gemm.gemm(x[i : i + 1], packed, n, b)
            assert torch.equal(alone[0], batched[i]), f"row {i} differs when computed alone (bias={b is not None})"
        # and any sub-batch, wherever it starts
        for a, z in ((5, 22), (30, 42), (3, 68)):
            assert torch.equal(gemm.gemm(x[a:z], packed, n, b), batched[a:z]), (a, z)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("m", [1, 3, 17, 32, 70])
def test_widened_output_is_the_bf16_output_widened(gemm, dtype, m):
    """The float32-output GEMM (a bf16 LM head's logits) stores exactly `.float()` of the bf16
    GEMM's output, with and without a bias, N not a whole number of tiles; None where only the
    AVX2 GEMM runs."""
    torch.manual_seed(m)
    n, k = 200, 576
    x, w, bias = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype) / math.sqrt(k), randn(n, dtype=dtype)
    packed = gemm.pack_weight(w)
    for b in (None, bias):
        widened = gemm.gemm_bf16_widened(x, packed=packed, n=n, bias=b)
        if not gemm.avx512_bf16:
            assert widened is None
            return
        assert widened.dtype == torch.float32 and torch.equal(widened, gemm.gemm(x, packed, n, b).float())
    wide = randn(m, k + 64, dtype=dtype)  # rows further apart than K
    assert torch.equal(gemm.gemm_bf16_widened(wide[:, :k], packed=packed, n=n, bias=bias),
                       gemm.gemm(wide[:, :k], packed, n, bias).float())


@DTYPES
def test_gemm_strided_rows(gemm, dtype):
    """Rows with a stride larger than K (every other row, a column window, a transposed view)."""
    torch.manual_seed(1)
    n, k = 40, 64
    w, bias = randn(n, k, dtype=dtype) / 8, randn(n, dtype=dtype)
    packed = gemm.pack_weight(w)
    base = randn(10, k + 13, dtype=dtype)
    views = {
        "every other row": base[::2, :k],
        "column window at an odd offset": base[:, 3 : 3 + k],
        "transposed (column-major)": randn(k, 7, dtype=dtype).t(),
    }
    for label, x in views.items():
        assert not x.is_contiguous(), label
        y = gemm.gemm(x, packed, n, bias)
        assert torch.equal(y, gemm.gemm(x.contiguous(), packed, n, bias)), label
        assert_close_to_exact(y, reference_linear(x, w, bias), dtype)


@DTYPES
def test_gemm_non_contiguous_bias(gemm, dtype):
    torch.manual_seed(3)
    x, w = randn(3, 64, dtype=dtype), randn(40, 64, dtype=dtype) / 8
    bias = randn(80, dtype=dtype)[::2]
    y = gemm.gemm(x, gemm.pack_weight(w), 40, bias)
    assert_close_to_exact(y, reference_linear(x, w, bias), dtype)


@DTYPES
def test_gemm_rejects_bad_shapes(gemm, dtype):
    packed = gemm.pack_weight(randn(40, 64, dtype=dtype))
    with pytest.raises(ValueError, match="does not fit"):  # K mismatch
        gemm.gemm(randn(3, 62, dtype=dtype), packed, 40)
    with pytest.raises(ValueError, match="does not fit"):  # more columns than the packed tiles hold
        gemm.gemm(randn(3, 64, dtype=dtype), packed, 49)
    with pytest.raises(ValueError, match="does not fit"):  # not a matrix
        gemm.gemm(randn(2, 3, 64, dtype=dtype), packed, 40)


def test_pack_weight_rejects_what_it_cannot_pack(kernels):
    with pytest.raises(ValueError, match="K even"):  # odd K cannot be packed in bf16 k-pairs
        kernels.pack_weight(randn(40, 63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float16"):
        kernels.pack_weight(randn(40, 64, dtype=torch.float16))


@DTYPES
@pytest.mark.parametrize("which", ["bias", "x"])
def test_gemm_rejects_mixed_dtypes(gemm, dtype, which):
    """Operands kvflow's own Linear never passes: a bias or x of the other dtype is refused."""
    torch.manual_seed(2)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    x, w, bias = randn(3, 64, dtype=dtype), randn(40, 64, dtype=dtype) / 8, randn(40, dtype=dtype)
    packed = gemm.pack_weight(w)
    if which == "bias":
        bias = bias.to(other)
    else:
        x = x.to(other)
    with pytest.raises(ValueError, match="share one dtype"):
        gemm.gemm(x, packed, 40, bias)


@DTYPES
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_avx2_blocks_give_the_avx512_bits(gemm, dtype, with_bias):
    """Without AVX-512 the GEMM sums every output in the AVX-512 kernels' order, bf16 k-pairs as
    vdpbf16ps does (odd product first, denormals flushed): the same bits on every CPU type, so a
    token never depends on which one served it. Compared with the SIMDe-emulated AVX-512 build at
    every AVX2 block size (5 rows bf16, 6 float32) and ragged N."""
    if gemm.avx512_bf16 if dtype == torch.bfloat16 else gemm.avx512f:
        pytest.skip(f"this CPU runs the AVX-512 {dtype} GEMM itself")
    avx512 = cpu_kernels.load_emulated_avx512()
    for m in (1, 2, 4, 5, 6, 7, 11, 13, 16, 70):
        for n, k in ((40, 64), (200, 576)):
            g = torch.Generator().manual_seed(m * 1000 + n + k)
            x, w = randn(m, k, dtype=dtype, generator=g), randn(n, k, dtype=dtype, generator=g) / math.sqrt(k)
            bias = randn(n, dtype=dtype, generator=g) if with_bias else None
            if dtype == torch.bfloat16:  # vdpbf16ps reads denormal inputs as zero
                x, w = with_denormals(x, g), with_denormals(w, g)
                x[0, :], w[0, :] = 1e-19, 1e-19  # products that underflow: flushed, not summed
                if bias is not None:
                    bias[1] = 3e-39  # a denormal bias, which the rounding to bf16 flushes
            got = gemm.gemm(x, gemm.pack_weight(w), n, bias)
            expected = avx512.gemm(x, avx512.pack_weight(w), n, bias)
            assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (m, n, k)


@DTYPES
def test_gemm_does_not_depend_on_the_thread_count(gemm, dtype):
    """A column chunk is one thread's work, summed in one order: 1 thread and 2 give the same bits."""
    torch.manual_seed(4)
    m, n, k = 40, 200, 576
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype) / math.sqrt(k)
    packed = gemm.pack_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm.gemm(x, packed, n)
        torch.set_num_threads(2)
        two = gemm.gemm(x, packed, n)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_amx_runs_only_whole_k_tiles(kernels):
    """K not a multiple of 32 runs the vector blocks even with AMX on (a per-layer choice, never per
    batch); telltale rows (`amx_telltale_rows`) show which unit summed."""
    with amx_mode(kernels, "auto"):
        sums = {}
        for k in (48, 64):
            packed = kernels.pack_weight(torch.ones(16, k, dtype=torch.bfloat16))
            for mode in ("on", "off"):
                kernels.set_amx(mode)
                sums[k, mode] = kernels.gemm(amx_telltale_rows(3, k), packed, 16).float().unique().tolist()
        assert sums[48, "on"] == sums[48, "off"] == [0.0]
        assert sums[64, "off"] == [0.0] and sums[64, "on"] == [32.0], sums


def test_amx_choice_is_checked(kernels):
    with amx_mode(kernels, "off"):
        with pytest.raises(ValueError, match="KVFLOW_AMX"):
            kernels.set_amx("yes")
        assert kernels.set_amx("off") is False
        if kernels.set_amx("auto"):
            assert kernels.set_amx("on") is True
        else:
            with pytest.raises(ValueError, match="no AMX"):
                kernels.set_amx("on")


@DTYPES
def test_gemm_rows_past_a_panel_are_batch_invariant(gemm, dtype):
    """Prefill-sized M runs in row panels on AMX (about 1 MiB of x: 320 rows at K = 1,536): rows in
    the second and third panel, and the ragged end, are the rows computed alone."""
    torch.manual_seed(6)
    m, n, k = 700, 72, 1536
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype) / math.sqrt(k)
    packed = gemm.pack_weight(w)
    batched = gemm.gemm(x, packed, n)
    assert_close_to_exact(batched, reference_linear(x, w, None), dtype)
    for i in (0, 319, 320, 331, 640, 699):
        assert torch.equal(gemm.gemm(x[i : i + 1], packed, n)[0], batched[i]), i


@DTYPES
def test_gemm_strided_row_tiles(gemm, dtype):
    """Row-strided x (as a Linear gets from a fused projection's slice) over one, one and a half
    and two row tiles: on AMX, full tiles are read in place and a ragged end from a padded copy of
    another stride. Each count gives the contiguous result, and every row its row alone."""
    torch.manual_seed(7)
    n, k = 40, 64
    w = randn(n, k, dtype=dtype) / 8
    packed = gemm.pack_weight(w)
    base = randn(45, k + 24, dtype=dtype)
    for m in (16, 24, 32, 45):
        x = base[:m, 8 : 8 + k]
        y = gemm.gemm(x, packed, n)
        assert torch.equal(y, gemm.gemm(x.contiguous(), packed, n)), m
        assert_close_to_exact(y, reference_linear(x, w, None), dtype)
        for i in (0, m // 2, m - 1):
            assert torch.equal(gemm.gemm(x[i : i + 1], packed, n)[0], y[i]), (m, i)


@DTYPES
def test_gemm_of_no_rows(gemm, dtype):
    y = gemm.gemm(randn(0, 64, dtype=dtype), gemm.pack_weight(randn(40, 64, dtype=dtype)), 40)
    assert y.shape == (0, 40)


def test_vector_units_pause_amx_and_restore_it(kernels):
    """`vector_units` (a speculative draft's one-row forwards) runs its calls on the vector
    blocks, telltale rows show, and leaves AMX on after, also when the body raises."""
    with amx_mode(kernels, "auto"):
        packed = kernels.pack_weight(torch.ones(16, 64, dtype=torch.bfloat16))
        x = amx_telltale_rows(1, 64)
        with kernels.vector_units():
            assert kernels.gemm(x, packed, 16).float().unique().tolist() == [0.0]
        assert kernels.gemm(x, packed, 16).float().unique().tolist() == [32.0]
        with pytest.raises(RuntimeError, match="inside"), kernels.vector_units():
            raise RuntimeError("inside")
        assert kernels.amx and kernels.gemm(x, packed, 16).float().unique().tolist() == [32.0]
