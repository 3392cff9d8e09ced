"""Quantized weights in the bf16 GEMM's tiles (csrc/quant_gemm_bf16.cpp, quantization/tiles.py).

The tiles multiply by the dequantized weight itself (no bf16 rounding of weights), summed group
by group in float32: each case is compared with a float64 product within float32 accumulation
error, and a row must not depend on the rows beside it. On CPUs without AVX512-BF16 the kernels
run in the SIMDe-emulated build (csrc/isa.h), so every CI machine checks the numerics. Where the
CPU has AMX, every such test runs again on the tiles (other bits, the same bounds and invariance);
there groups of under 256 inputs multiply the dequantized weights rounded to bf16
(csrc/quant_gemm_amx_folded.h): the bounds are then against those weights, and such a layer gives
the bf16 GEMM's bits for them (tests/quantization/test_tiles_amx.py: the AMX-only bits and layouts).
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers import cpu_kernels
from kvflow.quantization import methods, tiles
from kvflow.quantization.qweight import QuantizedWeight
from tests.layers.test_bf16_dot import with_denormals
from tests.layers.test_gemm import amx_mode


@pytest.fixture(scope="module", params=["vector", "amx"])
def lib(kernels, request):
    """(kernels, tile library): native where the CPU has AVX512-BF16, else the emulated build;
    then the native one on AMX tiles (csrc/quant_gemm_amx.h) where the CPU has them."""
    with amx_mode(kernels, "auto" if request.param == "amx" else "off"):
        k = kernels if request.param == "amx" or kernels.avx512_bf16 else cpu_kernels.load_emulated_avx512()
        yield k, tiles._bind(k.lib)


def _weights(n: int, k: int, seed: int) -> list[QuantizedWeight]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    asymmetric = QuantizedWeight(*[getattr(methods.quantize_int8(w, 32), f) for f in ("qweight", "scales")],
                                 torch.randn(n, k // 32, generator=torch.Generator().manual_seed(seed)) * 0.01,
                                 8, 32, k, "int8 with offsets")  # a widened shard's or an asymmetric checkpoint's
    return [methods.quantize_int8(w), methods.quantize_int8(w, 32), asymmetric, methods.quantize_int4(w, 32),
            methods.quantize_int4(w, 64), methods.quantize_int4(w, 16)]


def folds(kernels, qw: QuantizedWeight) -> bool:
    """Whether the AMX tiles multiply `qw`'s dequantized weights rounded to bf16: groups of whole
    k tiles (32), fewer than csrc/quant_gemm_amx.h's kBlockedGroupTiles (8) of them."""
    return kernels.amx and qw.group_size % 32 == 0 and qw.in_features % 32 == 0 and qw.group_size < 8 * 32


def _check(op_f32, op_bf16, op_bias, qw: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor,
           folded: bool = False) -> None:
    """float32 logits within float32 accumulation error of the float64 product with the weights
    multiplied (dequantized; `folded`: rounded to bf16 as well); the bf16 outputs are those
    logits (+ the bf16 bias) rounded once."""
    logits = op_f32(x)
    w = qw.dequantize()
    w = (w.to(torch.bfloat16) if folded else w).double()
    ref, size = x.double() @ w.T, x.double().abs() @ w.abs().T
    assert ((logits.double() - ref).abs() <= 1e-5 * size + 1e-30).all(), qw.source
    assert torch.equal(op_bf16(x), logits.to(torch.bfloat16))
    assert torch.equal(op_bias(x), (logits + bias.to(torch.bfloat16).float()).to(torch.bfloat16))


@pytest.mark.parametrize("n,k,m", [(50, 128, 1), (40, 128, 3), (64, 192, 7), (96, 64, 8), (200, 64, 13), (40, 256, 70)])
def test_tiles_equal_their_definition(lib, n, k, m):
    kernels, tile_lib = lib
    g = torch.Generator().manual_seed(n * k + m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    for qw in _weights(n, k, seed=m):
        t = tiles.pack(qw, lib=tile_lib)
        op_f32 = tiles.prepare(t, float32_out=True, lib=tile_lib)
        op_bf16, op_bias = tiles.prepare(t, lib=tile_lib), tiles.prepare(t, bias, lib=tile_lib)
        _check(op_f32, op_bf16, op_bias, qw, x, bias, folds(kernels, qw))


@pytest.mark.parametrize("which", [0, 2, 3])  # int8 per channel, int8 with offsets, int4
def test_tiles_are_batch_invariant(lib, which):
    """A row's output does not depend on the rows beside it: one row, the in-register decode
    rows (blocks of up to 8, up to 32 rows), 12-row and 8-row blocks of a stored tile, and a partial
    last tile; on AMX one row tile (16), one and a half (24) and two (32)."""
    _, tile_lib = lib
    qw = _weights(104, 128, seed=1)[which]
    op = tiles.prepare(tiles.pack(qw, lib=tile_lib), float32_out=True, lib=tile_lib)
    x = torch.randn(80, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole = op(x)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 11), slice(3, 12), slice(3, 15), slice(0, 16), slice(3, 27),
                 slice(8, 40), slice(2, 35), slice(10, 80)):
        assert torch.equal(op(x[rows].contiguous()), whole[rows]), rows


@pytest.mark.parametrize("which", ["int8", "int8 g256", "int8 g256 with offsets", "int4 g256"])
def test_long_group_tiles_are_batch_invariant(lib, which):
    """Groups of 8 k tiles or more (int8 per channel at K = 512: 16) take their own path at each
    size on AMX: 17-32 rows keep every sum tile of a column chunk in flight at once. Rows there
    equal the rows alone and in a prefill-sized call, and the sums stay within float32 error of
    the dequantized weight (ragged N: 104 columns leave a chunk of one column tile)."""
    kernels, tile_lib = lib
    n, k = 104, 512
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.1
    qw = {"int8": lambda: methods.quantize_int8(w), "int8 g256": lambda: methods.quantize_int8(w, 256),
          "int4 g256": lambda: methods.quantize_int4(w, 256),
          "int8 g256 with offsets": lambda: QuantizedWeight(
              *[getattr(methods.quantize_int8(w, 256), f) for f in ("qweight", "scales")],
              torch.randn(n, k // 256, generator=torch.Generator().manual_seed(6)) * 0.01, 8, 256, k, which)}[which]()
    t = tiles.pack(qw, lib=tile_lib)
    op = tiles.prepare(t, float32_out=True, lib=tile_lib)
    x = torch.randn(80, k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    whole = op(x)
    for rows in (slice(0, 1), slice(0, 16), slice(0, 17), slice(3, 27), slice(8, 40), slice(2, 34), slice(5, 70)):
        assert torch.equal(op(x[rows].contiguous()), whole[rows]), rows
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8))
    _check(op, tiles.prepare(t, lib=tile_lib), tiles.prepare(t, bias, lib=tile_lib), qw, x[3:27].contiguous(), bias,
           folds(kernels, qw))


@pytest.mark.parametrize("which", [0, 3])  # int8 per channel, int4
def test_tiles_rows_past_a_panel_are_batch_invariant(lib, which):
    """On AMX a prefill-sized call runs in row panels (320 rows at K = 1,536): rows of the second
    panel and of its ragged end (405 = 25 x 16 + 5) are the rows computed alone."""
    _, tile_lib = lib
    qw = _weights(40, 1536, seed=3)[which]
    op = tiles.prepare(tiles.pack(qw, lib=tile_lib), float32_out=True, lib=tile_lib)
    x = torch.randn(405, 1536, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    whole = op(x)
    for i in (0, 319, 320, 399, 400, 404):
        assert torch.equal(op(x[i : i + 1].contiguous())[0], whole[i]), i


def _float32_scales(qw: QuantizedWeight) -> QuantizedWeight:
    """`qw` with scales float16 cannot hold (float32's full significand): the AMX_ROWS layout."""
    return QuantizedWeight(qw.qweight, qw.scales * (1 + 2**-20), qw.offsets, qw.bits, qw.group_size, qw.in_features,
                           qw.source)


@pytest.mark.parametrize("group", [32, 64])
def test_half_layout_packs_float16_headers_and_refuses_other_values(lib, group):
    """The packer (plain C++, every machine): each group's block starts with its columns'
    scales and offsets as float16 bits (zeros past N), then layout 1's k tiles; zero, negative
    zero, the largest float16 and its subnormals are taken, any value float16 cannot hold is
    refused rather than rounded."""
    _, tile_lib = lib
    gen = torch.Generator().manual_seed(group)
    n, k = 40, 128  # three column tiles, the last one half empty
    groups, tiles_per_group = k // group, group // 32
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, groups, generator=gen) * 0.01).half().float()
    scales.view(-1)[:5] = torch.tensor([65504.0, 2.0**-14, 2.0**-24, 1023 * 2.0**-24, 0.0])
    offsets = (-torch.rand(n, groups, generator=gen) * 0.1).half().float()
    offsets.view(-1)[:2] = torch.tensor([-0.0, -65504.0])

    def packed(layout: int, s: torch.Tensor, o: torch.Tensor) -> tuple[int, torch.Tensor]:
        out = torch.empty(tile_lib.kvflow_quant_tiles_bytes(4, layout, group, n, k), dtype=torch.uint8)
        side = [torch.empty(3, groups, 16) for _ in range(2)] if layout == tiles.AMX_ROWS else [None, None]
        rc = tile_lib.kvflow_pack_quant_tiles(4, layout, q.data_ptr(), s.data_ptr(), o.data_ptr(), group, n, k,
                                              out.data_ptr(), *(None if t is None else t.data_ptr() for t in side))
        return rc, out

    rc, half = packed(tiles.AMX_ROWS_HALF, scales, offsets)
    assert rc == 0
    rc, rows = packed(tiles.AMX_ROWS, scales, offsets)
    assert rc == 0
    block, tile_bytes = 64 + group * 8, groups * (64 + group * 8)
    for t in range(3):
        cols = range(16 * t, min(n, 16 * t + 16))
        for g in range(groups):
            head = half[t * tile_bytes + g * block:][:64].view(torch.int16)
            want = torch.zeros(32, dtype=torch.int16)
            want[: len(cols)] = scales[list(cols), g].half().view(torch.int16)
            want[16: 16 + len(cols)] = offsets[list(cols), g].half().view(torch.int16)
            assert torch.equal(head, want), (t, g)
            for j in range(tiles_per_group):
                kt = g * tiles_per_group + j
                start = t * tile_bytes + g * block + 64 + j * 256
                assert torch.equal(half[start: start + 256], rows[t * k * 8 + kt * 256:][:256]), (t, kt)
    for bad in (65520.0, 1 + 2.0**-11, 1.5 * 2.0**-24, 2.0**-25, float("inf"), float("nan"), 1e-40):
        for which in ("scale", "offset"):
            s, o = scales.clone(), offsets.clone()
            (s if which == "scale" else o)[3, 1] = bad
            assert packed(tiles.AMX_ROWS_HALF, s, o)[0] == -1, (which, bad)
            assert not tiles.float16_values(s if which == "scale" else o), (which, bad)


def test_tiles_pack_into_a_given_buffer(lib):
    """`out` (the loader's shared huge-page buffer) holds the same tiles as a pack of their own,
    in every layout; a buffer of the wrong size is refused."""
    kernels, tile_lib = lib
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(40, 96, generator=gen) * 0.1
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    for qw in (methods.quantize_int4(w, 32), _float32_scales(methods.quantize_int4(w, 32)), methods.quantize_int8(w),
               methods.quantize_int8(w, 32)):
        size = tiles.packed_bytes(qw, lib=tile_lib)
        out = torch.full((size + 64,), 0xAB, dtype=torch.uint8)[64:]  # stale bytes, 64-byte offset
        placed = tiles.pack(qw, lib=tile_lib, out=out)
        assert placed.q.data_ptr() == out.data_ptr()
        own = tiles.pack(qw, lib=tile_lib)
        assert placed.layout == own.layout
        assert torch.equal(tiles.prepare(placed, lib=tile_lib)(x), tiles.prepare(own, lib=tile_lib)(x))
        with pytest.raises(ValueError, match="must be"):
            tiles.pack(qw, lib=tile_lib, out=out[:-1])
        if size % 2 == 0:
            with pytest.raises(ValueError, match="one dimension"):
                tiles.pack(qw, lib=tile_lib, out=out.view(2, -1))


@pytest.mark.parametrize("out", ["float32", "bf16", "bf16+bias"])
def test_avx2_tiles_give_the_avx512_bits(kernels, out):
    """Without AVX512-BF16 the tiles run on AVX2 + FMA (csrc/quant_gemm_avx2.h) in the AVX-512
    kernel's order, vdpbf16ps's pairs as two FMAs under DAZ/FTZ: the same bits as the emulated
    AVX-512 build, at the in-register row blocks (1-4 rows, two tiles for 1-2), the stored-tile
    blocks (16 rows on, up to 5), ragged N, every weight format, and denormal activations."""
    if kernels.avx512_bf16:
        pytest.skip("this CPU runs the AVX512-BF16 tiles itself")
    if not tiles.available():
        pytest.skip("this CPU has neither AVX512-BF16 nor AVX2 + FMA")
    native, avx512 = tiles._bind(kernels.lib), tiles._bind(cpu_kernels.load_emulated_avx512().lib)
    for m in (1, 2, 3, 5, 9, 15, 16, 17, 23, 40):
        for n, k in ((40, 64), (136, 576)):
            g = torch.Generator().manual_seed(m * 1000 + n)
            x = with_denormals(torch.randn(m, k, generator=g).to(torch.bfloat16), g)
            if m % 2:  # a row of denormals: its sums are zero under DAZ, tiny but not zero without
                x[m // 2] = with_denormals(torch.zeros(k, dtype=torch.bfloat16), g)
            bias = torch.randn(n, generator=g) if out == "bf16+bias" else None
            for qw in _weights(n, k, seed=m):
                got, expected = (tiles.prepare(tiles.pack(qw, lib=lib), bias, out == "float32", lib=lib)(x)
                                 for lib in (native, avx512))
                bits = torch.int32 if out == "float32" else torch.int16
                assert torch.equal(got.view(bits), expected.view(bits)), (m, n, k, qw.source, qw.group_size)


def test_tiles_pack_a_gguf_q4_1_layout(lib):
    """4-bit values in GGUF's nibble order with Q4_1's minimum as the offset, as shipped."""
    kernels, tile_lib = lib
    g = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (48, 64), generator=g, dtype=torch.uint8)
    qw = QuantizedWeight(methods.pack_int4(q), torch.rand(48, 2, generator=g) * 0.05,
                         -torch.rand(48, 2, generator=g) * 0.3, 4, 32, 64, "gguf:Q4_1")
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(48, generator=g)
    t = tiles.pack(qw, lib=tile_lib)
    _check(tiles.prepare(t, float32_out=True, lib=tile_lib), tiles.prepare(t, lib=tile_lib),
           tiles.prepare(t, bias, lib=tile_lib), qw, x, bias, folds(kernels, qw))


def test_tiles_refuse_what_they_cannot_pack(lib):
    _, tile_lib = lib
    qw = methods.quantize_int8(torch.randn(16, 64), 32)
    odd = QuantizedWeight(qw.qweight[:, :63].contiguous(), qw.scales, None, 8, 63, 63, "int8")
    assert not tiles.supports(odd)
    with pytest.raises(ValueError, match="quantized tiles: groups of 63 over 63 inputs"):
        tiles.pack(odd, lib=tile_lib)
    op = tiles.prepare(tiles.pack(qw, lib=tile_lib), lib=tile_lib)
    with pytest.raises(TypeError, match="bf16 tiles and got torch.float32"):
        op(torch.randn(2, 64))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_bf16_engine_runs_on_tiles_in_the_fused_stack(kernels, tiny_models, monkeypatch, method):
    """Where the tiles run (AVX512-BF16, or AVX2 + FMA) a quantized bf16 model packs its linears
    as tiles, releases the row layout, and the one-call stack runs them: the same tokens and
    logprobs as the module path."""
    if not tiles.available():
        pytest.skip("the quantized tiles need AVX512-BF16 or AVX2 + FMA")
    path, _ = tiny_models("llama")
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVFLOW_FUSED_STACK", flag)
        llm = LLM(path, dtype="bfloat16", quantization=method, kv_cache_memory=1 << 22, max_num_batched_tokens=48)
        model = llm.engine.runner.model
        down = model.layers[0].mlp.down_proj
        assert down.packing == "quantized-tiles" and down.quant_weight.qweight.device.type == "meta"
        assert down.quant_weight.source == method
        amx_rows = kernels.amx and method == "int4"  # the AMX-only layout, through the stack's struct too
        assert (down.quant_tiles.layout == tiles.AMX_ROWS_HALF) == amx_rows  # quantize_int4's float16 scales
        storages = {m.quant_tiles.q.untyped_storage().data_ptr() for m in model.modules() if
                    getattr(m, "quant_tiles", None) is not None}
        assert len(storages) == 1, "the tiles are not in the loader's one buffer"
        outs = llm.generate(prompts, params, use_tqdm=False)
        if flag == "1":
            assert model.fused_stack is not None and model.fused_stack.steps_run > 0
            assert model.fused_stack.steps_declined == 0
        results[flag] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results["1"] == results["0"]
