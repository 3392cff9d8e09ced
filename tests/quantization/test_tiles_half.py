"""Float16 scales and offsets beside the k-pair tiles (tiles.PAIRS_HALF, layout 3 of
csrc/quant_gemm_bf16.cpp): packed where the AVX512-BF16 or the AVX2 + F16C kernel runs the tiles
(no AMX), for weights whose every scale and offset is a float16 value. They must give the bits of
the same weight packed with float32 scales, at the in-register row blocks and the stored-tile
ones, and take a sixth fewer bytes for 4-bit groups of 32. The SIMDe-emulated build runs them
wherever the CPU lacks AVX512-BF16 (or has AMX), so every CI machine checks the AVX-512 kernel's
reading of the layout; an AVX2 CPU checks its own as well."""

from __future__ import annotations

import pytest
import torch

from kvflow.layers import cpu_kernels
from kvflow.quantization import methods, tiles
from kvflow.quantization.qweight import QuantizedWeight


@pytest.fixture(scope="module", params=["native", "emulated"])
def tile_lib(kernels, request):
    """A library that packs PAIRS_HALF: this CPU's own (AVX512-BF16 or AVX2 + F16C, without
    AMX), and the emulated AVX-512 one where the CPU's own kernel is not AVX512-BF16."""
    if request.param == "native":
        lib = tiles._bind(kernels.lib)
        if lib.kvflow_quant_tiles_layout(4, 32, 128, 1) != tiles.PAIRS_HALF:
            pytest.skip("this CPU's tile kernel does not take float16 scales (AMX, or no AVX2 + F16C)")
        return lib
    if kernels.avx512_bf16 and not kernels.has_amx:
        pytest.skip("the native library is the AVX-512 kernel itself")
    return tiles._bind(cpu_kernels.load_emulated_avx512().lib)


def _halved(qw: QuantizedWeight) -> QuantizedWeight:
    """`qw` with its scales and offsets rounded to float16 values (as a GGUF file's are)."""
    offsets = None if qw.offsets is None else qw.offsets.half().float()
    return QuantizedWeight(qw.qweight, qw.scales.half().float(), offsets, qw.bits, qw.group_size, qw.in_features,
                           qw.source)


def _weights(n: int, k: int, seed: int) -> list[QuantizedWeight]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    w[3] *= 1e-5  # groups whose float16 scales are subnormal
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    q4_1 = QuantizedWeight(methods.pack_int4(q), (torch.rand(n, k // 32, generator=g) * 0.05).half().float(),
                           (-torch.rand(n, k // 32, generator=g) * 0.3).half().float(), 4, 32, k, "gguf:Q4_1")
    with_offsets = QuantizedWeight(*[getattr(methods.quantize_int8(w, 32), f) for f in ("qweight", "scales")],
                                   torch.randn(n, k // 32, generator=g) * 0.01, 8, 32, k, "int8 with offsets")
    return [methods.quantize_int4(w, 32), methods.quantize_int4(w, 64), q4_1, _halved(methods.quantize_int8(w, 32)),
            _halved(with_offsets), _halved(methods.quantize_int8(w))]


def _packed(qw: QuantizedWeight, layout: int, lib) -> tiles.QuantTiles:
    """`qw` packed in `layout` whatever the library would choose: the C packer called directly."""
    n, k = qw.out_features, qw.in_features
    dtype = torch.float16 if layout == tiles.PAIRS_HALF else torch.float32
    shape = (-(-n // tiles.TILE_COLS), k // qw.group_size, tiles.TILE_COLS)
    q = torch.empty(lib.kvflow_quant_tiles_bytes(qw.bits, layout, qw.group_size, n, k), dtype=torch.uint8)
    scales = torch.empty(shape, dtype=dtype)
    offsets = torch.empty(shape, dtype=dtype) if qw.offsets is not None or qw.bits == 4 else None
    src_offsets = None if qw.offsets is None else qw.offsets.float().contiguous()
    rc = lib.kvflow_pack_quant_tiles(qw.bits, layout, qw.qweight.contiguous().data_ptr(),
                                     qw.scales.float().contiguous().data_ptr(),
                                     None if src_offsets is None else src_offsets.data_ptr(), qw.group_size, n, k,
                                     q.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr())
    assert rc == 0, (qw.source, layout)
    return tiles.QuantTiles(q, scales, offsets, qw.bits, qw.group_size, k, n, layout)


def test_float16_valued_weights_pack_with_float16_scales(tile_lib):
    """tiles.pack takes PAIRS_HALF exactly where every scale and offset is a float16 value; 4-bit
    groups of 32 then take 12 bytes per 16 x 32 weights' quants' 16 instead of 16 + 8 + 8."""
    n, k = 48, 128
    for qw in _weights(n, k, seed=1):
        assert tiles.pack(qw, lib=tile_lib).layout == tiles.PAIRS_HALF, qw.source
    full = methods.quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(2)))
    assert not tiles.float16_values(full.scales)
    assert tiles.pack(full, lib=tile_lib).layout == tiles.PAIRS
    int4 = _weights(n, k, seed=1)[0]
    half, single = tiles.pack(int4, lib=tile_lib), _packed(int4, tiles.PAIRS, tile_lib)
    assert half.nbytes == n * k // 2 + 2 * (n * k // 32) * 2
    assert single.nbytes - half.nbytes == 2 * (n * k // 32) * 2
    assert tiles.packed_bytes(int4, lib=tile_lib) == half.nbytes  # each tensor's size a multiple of 64 here


@pytest.mark.parametrize("m", [1, 2, 5, 12, 13, 24, 32, 33, 70])
def test_float16_scales_give_the_float32_scales_bits(tile_lib, m):
    """Every format (int4 in two group sizes, GGUF Q4_1, int8 per group with and without offsets,
    per channel), ragged N, float32 and bf16 outputs with a bias: the same bits either layout."""
    n, k = 40, 128
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    for qw in _weights(n, k, seed=m):
        half, single = _packed(qw, tiles.PAIRS_HALF, tile_lib), _packed(qw, tiles.PAIRS, tile_lib)
        for b, out32 in ((None, True), (None, False), (bias, False)):
            got = tiles.prepare(half, b, out32, lib=tile_lib)(x)
            expected = tiles.prepare(single, b, out32, lib=tile_lib)(x)
            bits = torch.int32 if out32 else torch.int16
            assert torch.equal(got.view(bits), expected.view(bits)), (qw.source, qw.group_size, m, b is not None)


def test_float16_layout_refuses_other_values(tile_lib):
    """A scale or offset float16 cannot hold is refused by the packer, not rounded."""
    n, k = 16, 64
    qw = methods.quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.1, 32)
    for field in ("scales", "offsets"):
        values = {"scales": qw.scales.clone(), "offsets": qw.offsets.clone()}
        values[field][5, 1] = 1.0 + 2.0 ** -20
        bad = QuantizedWeight(qw.qweight, values["scales"], values["offsets"], 4, 32, k, "int4")
        q = torch.empty(tile_lib.kvflow_quant_tiles_bytes(4, tiles.PAIRS_HALF, 32, n, k), dtype=torch.uint8)
        side = [torch.empty(1, k // 32, 16, dtype=torch.float16) for _ in range(2)]
        rc = tile_lib.kvflow_pack_quant_tiles(4, tiles.PAIRS_HALF, bad.qweight.data_ptr(), bad.scales.data_ptr(),
                                              bad.offsets.data_ptr(), 32, n, k, q.data_ptr(), side[0].data_ptr(),
                                              side[1].data_ptr())
        assert rc == -1, field
        assert tiles.pack(bad, lib=tile_lib).layout == tiles.PAIRS
