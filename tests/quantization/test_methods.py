"""Quantizing float weights at load: error bounds, zeros, and the options' refusals."""

from __future__ import annotations

import pytest
import torch

from kvflow.quantization import methods
from kvflow.quantization.config import QuantizationConfig
from kvflow.quantization.methods import quantize_int4, quantize_int8
from kvflow.quantization.qweight import cat_rows


def test_int8_error_within_half_a_step():
    w = torch.randn(64, 128)
    qw = quantize_int8(w)
    assert qw.qweight.dtype == torch.int8 and qw.scales.shape == (64, 1) and qw.offsets is None
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-7).all()


def test_int4_error_within_half_a_step():
    w = torch.randn(32, 256)
    w[0] = 0.0
    w[1, :64] = 0.5  # a constant positive group
    qw = quantize_int4(w, 64)
    assert qw.qweight.shape == (32, 128) and qw.scales.shape == (32, 4)
    deq = qw.dequantize()
    groups = w.view(32, 4, 64)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    # the scale and minimum are float16 values: each within 2^-11 of its own size of the exact one
    grid = 2.0**-11 * (groups.amin(-1).abs() + groups.amax(-1) - groups.amin(-1))
    assert ((deq - w).view(32, 4, 64).abs() <= (step / 2 + grid).unsqueeze(-1) + 1e-6).all()
    assert torch.equal(qw.scales.half().float(), qw.scales) and torch.equal(qw.offsets.half().float(), qw.offsets)
    assert torch.equal(deq[0], torch.zeros(256)) and torch.equal(deq[1, :64], torch.full((64,), 0.5))
    assert int(qw.int_values().max()) <= 15


def test_int4_reproduces_a_q4_1_grid_exactly():
    """A group already on 16 evenly spaced levels (what a GGUF Q4_1 block holds: its step and
    minimum float16 values) is kept as is."""
    d, m = torch.tensor(0.0125).half().float(), torch.tensor(-0.1).half().float()
    q = torch.randint(0, 16, (8, 32))
    q[:, 0], q[:, 1] = 0, 15  # both ends present
    w = q.float() * d + m
    assert torch.equal(quantize_int4(w, 32).dequantize(), w)


@pytest.mark.parametrize("chunk", [1, 200, 1000])
def test_quantizing_by_row_slices_gives_the_whole_weights_values(monkeypatch, chunk):
    """A large weight is quantized a slice of rows at a time (bounded temporaries at load): the
    same quants, scales and offsets as one pass, and int4's float16-or-float32 choice still made
    for the whole weight (row 5's span is under float16's least subnormal step: float32 for all)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 192, generator=g).to(torch.bfloat16)
    flat = torch.randn(24, 192, generator=g)
    flat[5] = 1.0 + torch.arange(192) * 2.0 ** -30
    cases = [lambda: quantize_int8(w), lambda: quantize_int8(w, 32), lambda: quantize_int4(w, 32),
             lambda: quantize_int4(w, 64), lambda: quantize_int4(flat, 32)]
    whole = [case() for case in cases]
    monkeypatch.setattr(methods, "_CHUNK_VALUES", chunk)
    assert len(methods._row_chunks(w)) == -(-24 // max(1, chunk // 192))
    for case, expected in zip(cases, whole):
        got = case()
        for field in ("qweight", "scales", "offsets"):
            a, b = getattr(got, field), getattr(expected, field)
            assert (a is None and b is None) or torch.equal(a, b), field
    assert not torch.equal(whole[-1].scales, whole[-1].scales.half().float())  # float32 kept


def test_shards_stack_along_outputs():
    a, b = quantize_int4(torch.randn(8, 64)), quantize_int4(torch.randn(4, 64))
    both = cat_rows([a, b])
    assert both.shape == (12, 64)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    # Shards of different formats are widened to int8 with the groups' gcd, losslessly.
    c = quantize_int8(torch.randn(4, 64), 32)
    d = quantize_int8(torch.randn(2, 64))  # per channel: one group of 64
    mixed = cat_rows([a, c, d])
    assert (mixed.bits, mixed.group_size, mixed.source) == (8, 32, "int4+int8")
    assert torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), c.dequantize(), d.dequantize()]))
    with pytest.raises(ValueError, match="different input sizes"):
        cat_rows([a, quantize_int4(torch.randn(4, 96))])


@pytest.mark.parametrize(("args", "message"), [
    (("int3",), "quantization: 'int3' is not supported; choose one of none, int8, int4, gguf"),
    (("int4", 48), "int4 groups are whole 32-input blocks"),
    (("int8", 12), "int8 groups are multiples of 8"),
    (("int4", 0), "must be an integer >= 8"),
    (("gguf", 32), "does not apply to gguf"),
    ((None, 32), "quantization_group_size is set but quantization is not"),
])
def test_bad_options_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        QuantizationConfig.parse(*args)


def test_defaults():
    assert QuantizationConfig.parse("int4").group_size == 32
    assert QuantizationConfig.parse("int8").group_size is None
    assert QuantizationConfig.parse(None) is None and QuantizationConfig.parse("none") is None
    with pytest.raises(ValueError, match="layer mlp.down_proj has 160 inputs, which are not whole groups of 64"):
        QuantizationConfig.parse("int4", 64).check_layer("mlp.down_proj", 160)


def test_scales_are_float32_whatever_the_default_dtype():
    """The loader builds models under a bf16 default dtype; quantizing never inherits it."""
    w = torch.randn(8, 64)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        int8, int4 = quantize_int8(w, 32), quantize_int4(w, 32)
    finally:
        torch.set_default_dtype(previous)
    assert int8.scales.dtype == int4.scales.dtype == int4.offsets.dtype == torch.float32
