"""Quantized tiles on AMX (csrc/quant_gemm_amx*.h): where the tile unit runs them, what bits
they give, and which layout they are packed in.

Groups of under 256 inputs multiply their dequantized weights rounded to bf16, so a layer gives
the bf16 GEMM's bits for those weights, at every row count and past a row panel; 4-bit weights in
such groups are packed with the weights as the A tiles (tiles.AMX_ROWS), their scales and
offsets as float16 inside the quant stream where every one is a float16 value (AMX_ROWS_HALF),
and refused with a clear error if AMX is switched off after packing. Every test skips where the
CPU has no AMX (or Linux does not grant its tiles); tests/quantization/test_tiles.py covers the
kernels every machine runs.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.quantization import methods, tiles
from kvflow.quantization.qweight import QuantizedWeight
from tests.layers.test_gemm import amx_mode, amx_telltale_rows
from tests.quantization.test_tiles import _float32_scales, folds


def test_amx_tiles_sum_otherwise_than_vdpbf16ps(kernels):
    """The AMX path really runs for groups of 32: telltale rows (`amx_telltale_rows`) against an
    int8 weight of ones, scale 1, sum to 0 in vdpbf16ps's FMA chain and to K/2 on the tiles."""
    with amx_mode(kernels, "auto"):
        k = 64
        qw = QuantizedWeight(torch.ones(16, k, dtype=torch.int8), torch.ones(16, 2), None, 8, 32, k, "ones")
        tile_lib = tiles._bind(kernels.lib)
        op = tiles.prepare(tiles.pack(qw, lib=tile_lib), float32_out=True, lib=tile_lib)
        on = op(amx_telltale_rows(2, k)).unique().tolist()
        kernels.set_amx("off")
        off = op(amx_telltale_rows(2, k)).unique().tolist()
        assert (on, off) == ([32.0], [0.0])


def _q4_1(n: int, k: int, gen: torch.Generator, float16: bool) -> QuantizedWeight:
    """Random 4-bit values with a scale and minimum per 32, in float16 as a GGUF file stores
    them, or with float32's full significand."""
    rounded = (lambda t: t.half().float()) if float16 else (lambda t: t)
    return QuantizedWeight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                           rounded(torch.rand(n, k // 32, generator=gen) * 0.01),
                           rounded(-torch.rand(n, k // 32, generator=gen) * 0.1), 4, 32, k, "q4_1")


@pytest.mark.parametrize("which", ["int4 g32", "int4 g128", "q8_0", "int8 per channel, K 128", "gguf q4_1",
                                   "q4_1, float32 scales", "q8_0, float32 scales"])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 24, 33, 48, 70])
def test_amx_short_groups_give_the_bf16_gemms_bits(kernels, which, m):
    """On AMX a layer of short groups is the bf16 layer of its dequantized weights, bit for bit:
    the weights folded as q * s + o (two float32 roundings, as `dequantize` computes them), then
    to bf16, and summed as the bf16 GEMM sums (csrc/quant_gemm_amx_folded.h; 4 bits with the
    weights as A tiles, csrc/quant_gemm_amx_rows.h: x^T tiles of m columns under 16 rows, padded
    row tiles from 16, column tiles reread from 33)."""
    with amx_mode(kernels, "auto"):
        n, k = 72, 256 if which != "int8 per channel, K 128" else 128
        gen = torch.Generator().manual_seed(m)
        w = torch.randn(n, k, generator=gen) * 0.1
        q8 = methods.quantize_int8(w, 32)
        qw = {"int4 g32": lambda: methods.quantize_int4(w, 32), "int4 g128": lambda: methods.quantize_int4(w, 128),
              "q8_0": lambda: q8, "int8 per channel, K 128": lambda: methods.quantize_int8(w),
              "gguf q4_1": lambda: _q4_1(n, k, gen, float16=True),
              "q4_1, float32 scales": lambda: _q4_1(n, k, gen, float16=False),
              "q8_0, float32 scales": lambda: QuantizedWeight(q8.qweight, q8.scales * (1 + 2**-22), None, 8, 32, k,
                                                              which)}[which]()
        assert folds(kernels, qw)
        tile_lib = tiles._bind(kernels.lib)
        bias = torch.randn(n, generator=gen).to(torch.bfloat16)
        op = tiles.prepare(tiles.pack(qw, lib=tile_lib), bias, lib=tile_lib)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        packed = kernels.pack_weight(qw.dequantize().to(torch.bfloat16))
        assert torch.equal(op(x), kernels.gemm(x, packed, n, bias))


def test_amx_short_groups_past_a_panel_give_the_bf16_gemms_bits(kernels):
    """Past a row panel (64 rows at K = 8,160), where x^T is made again per panel for the
    row-layout kernel: still the bf16 GEMM's bits, with a strided x and a bias."""
    with amx_mode(kernels, "auto"):
        gen = torch.Generator().manual_seed(5)
        n, k = 40, 8160  # groups of 32 and of 96 (three k tiles) divide it
        tile_lib = tiles._bind(kernels.lib)
        bias = torch.randn(n, generator=gen).to(torch.bfloat16)
        for qw, layout in ((methods.quantize_int4(torch.randn(n, k, generator=gen) * 0.1, 32), tiles.AMX_ROWS_HALF),
                           (methods.quantize_int4(torch.randn(n, k, generator=gen) * 0.1, 96), tiles.AMX_ROWS_HALF),
                           (_float32_scales(methods.quantize_int4(torch.randn(n, k, generator=gen) * 0.1, 32)),
                            tiles.AMX_ROWS)):
            t = tiles.pack(qw, lib=tile_lib)
            assert t.layout == layout
            x = torch.randn(150, k + 64, generator=gen).to(torch.bfloat16)[:, 32 : 32 + k]  # rows k + 64 apart
            packed = kernels.pack_weight(qw.dequantize().to(torch.bfloat16))
            assert torch.equal(tiles.prepare(t, bias, lib=tile_lib)(x), kernels.gemm(x.contiguous(), packed, n, bias))


@pytest.mark.parametrize("m", [1, 40])
def test_amx_pair_tiles_of_4_bits_still_fold(kernels, m):
    """4-bit tiles packed while AMX was off (the k-pair layout) and run once it is on take the
    folded kernel: the same bits as the A-tile kernel on the same weight packed under AMX."""
    gen = torch.Generator().manual_seed(m)
    qw = methods.quantize_int4(torch.randn(40, 96, generator=gen) * 0.1, 32)
    x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
    tile_lib = tiles._bind(kernels.lib)
    with amx_mode(kernels, "off"):
        pairs = tiles.pack(qw, lib=tile_lib)
    with amx_mode(kernels, "auto"):
        rows = tiles.pack(qw, lib=tile_lib)
        assert (pairs.layout, rows.layout) == (tiles.PAIRS, tiles.AMX_ROWS_HALF)
        assert torch.equal(tiles.prepare(pairs, lib=tile_lib)(x), tiles.prepare(rows, lib=tile_lib)(x))


def test_amx_row_tiles_are_packed_for_short_4_bit_groups_only_and_refused_without_amx(kernels):
    """The A-tile layout only where the AMX kernel takes it; with AMX switched off after packing,
    a clear error rather than the vector kernels reading quants in an order they do not know."""
    w = torch.randn(32, 512, generator=torch.Generator().manual_seed(1)) * 0.1
    tile_lib = tiles._bind(kernels.lib)
    cases = {"int4 g32": methods.quantize_int4(w, 32), "int4 g128": methods.quantize_int4(w, 128),
             "int4 g32, float32 scales": _float32_scales(methods.quantize_int4(w, 32)),
             "int4 g256": methods.quantize_int4(w, 256), "int8 g32": methods.quantize_int8(w, 32),
             "int8": methods.quantize_int8(w)}
    with amx_mode(kernels, "off"):  # k-pair tiles; float16 scales where only vector kernels run them
        half = tiles.PAIRS_HALF if (kernels.avx512_bf16 or kernels.avx2_f16c) and not kernels.has_amx else tiles.PAIRS
        layouts = {name: tiles.pack(qw, lib=tile_lib).layout for name, qw in cases.items()}
        assert layouts == {"int4 g32": half, "int4 g128": half, "int4 g32, float32 scales": tiles.PAIRS,
                           "int4 g256": half, "int8 g32": tiles.PAIRS, "int8": tiles.PAIRS}
    with amx_mode(kernels, "auto"):
        layouts = {name: tiles.pack(qw, lib=tile_lib).layout for name, qw in cases.items()}
        assert layouts == {"int4 g32": tiles.AMX_ROWS_HALF, "int4 g128": tiles.AMX_ROWS_HALF,
                           "int4 g32, float32 scales": tiles.AMX_ROWS, "int4 g256": tiles.PAIRS,
                           "int8 g32": tiles.PAIRS, "int8": tiles.PAIRS}
        x = torch.randn(2, 512).to(torch.bfloat16)
        for name in ("int4 g32", "int4 g32, float32 scales"):
            op = tiles.prepare(tiles.pack(cases[name], lib=tile_lib), lib=tile_lib)
            before = op(x)
            with amx_mode(kernels, "off"):
                with pytest.raises(RuntimeError, match="packed for AMX"):
                    op(x)
            assert torch.equal(op(x), before)


def test_amx_half_layout_takes_exactly_the_float16_values(kernels):
    """Scales and offsets travel as float16 only when every one is a float16 value, subnormals
    included; a weight with a single other value keeps float32's (AMX_ROWS), and the packer
    refuses the float16 layout for it outright. Both give the bf16 GEMM's bits."""
    if not kernels.amx:
        pytest.skip("no AMX on this CPU (or Linux does not grant its tiles)")
    gen = torch.Generator().manual_seed(3)
    n, k = 40, 128
    tile_lib = tiles._bind(kernels.lib)
    subnormal = torch.randint(1, 1024, (n, k // 32), generator=gen).float() * 2.0**-24  # float16 subnormals
    qw = QuantizedWeight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen), subnormal,
                         (-torch.rand(n, k // 32, generator=gen) * 0.1).half().float(), 4, 32, k, "q4_1")
    one_off = subnormal.clone()
    one_off[7, 2] = 2.0**-25  # under the least float16 subnormal
    off_qw = QuantizedWeight(qw.qweight, one_off, qw.offsets, 4, 32, k, "q4_1")
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    with amx_mode(kernels, "auto"):
        for weight, layout in ((qw, tiles.AMX_ROWS_HALF), (off_qw, tiles.AMX_ROWS)):
            t = tiles.pack(weight, lib=tile_lib)
            assert t.layout == layout
            packed = kernels.pack_weight(weight.dequantize().to(torch.bfloat16))
            assert torch.equal(tiles.prepare(t, lib=tile_lib)(x), kernels.gemm(x, packed, n, None))
        q = torch.empty(tile_lib.kvflow_quant_tiles_bytes(4, tiles.AMX_ROWS_HALF, 32, n, k), dtype=torch.uint8)
        src_offsets = off_qw.offsets.contiguous()
        rc = tile_lib.kvflow_pack_quant_tiles(4, tiles.AMX_ROWS_HALF, off_qw.qweight.data_ptr(), one_off.data_ptr(),
                                              src_offsets.data_ptr(), 32, n, k, q.data_ptr(), None, None)
        assert rc == -1


def test_amx_fold_rounds_twice_where_products_are_inexact(kernels):
    """Where q * s is not exact in float32, the fold must round the product and the sum apart:
    one FMA would give other bf16 weights for some (q, s, o). Columns built from such cases
    (found among random float32 scales) and one-hot rows read the folded weights back."""
    with amx_mode(kernels, "auto"):
        gen = torch.Generator().manual_seed(0)
        s = torch.rand(2_000_000, generator=gen) * 0.01 + 1e-4
        o = -torch.rand(2_000_000, generator=gen) * 0.1
        q = torch.randint(1, 16, (2_000_000,), generator=gen).float()
        fused = (q.double() * s.double() + o.double()).float().to(torch.bfloat16)  # one rounding to float32
        telling = ((q * s + o).to(torch.bfloat16) != fused).nonzero().flatten()[:32]
        assert len(telling) == 32
        n, k = 32, 32  # column j: one group of q[j]'s, scale s[j], offset o[j]
        values = q[telling].to(torch.uint8).unsqueeze(1).expand(n, k).contiguous()
        qw = QuantizedWeight(methods.pack_int4(values), s[telling].unsqueeze(1), o[telling].unsqueeze(1), 4, 32, k, "q4_1")
        op = tiles.prepare(tiles.pack(qw, lib=tiles._bind(kernels.lib)), float32_out=True, lib=tiles._bind(kernels.lib))
        read = op(torch.eye(k, dtype=torch.bfloat16))  # read[i, j] = the weight of column j, input i
        assert torch.equal(read.T, qw.dequantize().to(torch.bfloat16).float())
