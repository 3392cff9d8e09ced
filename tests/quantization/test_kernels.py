"""The quantized GEMM (csrc/quant_gemm.cpp) against a float reference, and its invariances."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.quantization import kernels
from kvflow.quantization.methods import quantize_int4, quantize_int8
from kvflow.quantization.qweight import QuantizedWeight

needs_kernel = pytest.mark.skipif(not kernels.kernel_available(), reason="kvflow's CPU kernels did not build here")

FORMATS = {
    "int8-channel": lambda w: quantize_int8(w),
    "int8-g32": lambda w: quantize_int8(w, 32),
    "int4-g32": lambda w: quantize_int4(w, 32),
    "int4-g64": lambda w: quantize_int4(w, 64),
    "int4-g128": lambda w: quantize_int4(w, 128),
}


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 70])
def test_matches_dequantized_reference(fmt, rows):
    qw = FORMATS[fmt](_weight(75, 256))  # 75 outputs: a partial tile of 4 and an odd column
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ qw.dequantize().double().T
    y = kernels.quant_linear(x, qw)
    assert y.dtype == torch.float32 and y.shape == (rows, 75)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8-channel", "int4-g32"])
def test_kernel_multiplies_exactly_the_dequantized_weight(fmt):
    """One-hot rows pick single weights out: the tile is bit for bit `dequantize()`."""
    qw = FORMATS[fmt](_weight(16, 64))
    eye = torch.eye(64)
    assert torch.equal(kernels.quant_linear(eye, qw), qw.dequantize().T.contiguous())


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_invariant_and_portable_path_identical(fmt):
    qw = FORMATS[fmt](_weight(40, 512, seed=3))
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(4))
    batched = kernels.quant_linear(x, qw)
    alone = torch.cat([kernels.quant_linear(x[i : i + 1], qw) for i in range(13)])
    assert torch.equal(batched, alone)
    assert torch.equal(batched, kernels.quant_linear(x, qw, portable=True))


@needs_kernel
def test_bias_bf16_and_strided_input():
    qw = quantize_int4(_weight(24, 128, seed=5), 32)
    bias = torch.randn(24)
    x = torch.randn(6, 200)[:, 10:138]  # rows strided, inner stride 1
    ref = F.linear(x, qw.dequantize(), bias)
    torch.testing.assert_close(kernels.quant_linear(x, qw, bias), ref, rtol=0, atol=1e-4)
    xb = x.bfloat16()
    yb = kernels.quant_linear(xb, qw, bias)
    assert yb.dtype == torch.bfloat16
    # the kernel accumulates in float32 and rounds once: within one bf16 rounding of the float result
    exact = F.linear(xb.float(), qw.dequantize(), bias)
    assert ((yb.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()


def test_pytorch_fallback_is_the_same_product(monkeypatch):
    """Without the C++ library the layer dequantizes and multiplies: the same meaning."""
    qw = quantize_int8(_weight(8, 64))
    x = torch.randn(3, 64)
    monkeypatch.setattr(kernels, "_entry_point", lambda: None)
    torch.testing.assert_close(kernels.quant_linear(x, qw), F.linear(x, qw.dequantize()))


def test_packed_int4_layout_is_ggufs_nibble_order():
    q = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    from kvflow.quantization.methods import pack_int4

    packed = pack_int4(q)
    assert packed.tolist()[0] == [j | ((16 + j) % 16) << 4 for j in range(16)]
    qw = QuantizedWeight(packed, torch.ones(1, 1), None, 4, 32, 32, "test")
    assert qw.int_values().to(torch.uint8).tolist() == q.tolist()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5])
def test_float32_output_from_bf16_input_is_the_unrounded_accumulator(rows):
    """The LM head's path: bf16 activations in, float32 logits out, no bf16 rounding between."""
    qw = quantize_int8(_weight(64, 128, seed=7), 32)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(8)).bfloat16()
    y = kernels.quant_linear(x, qw, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), x.double() @ qw.dequantize().double().T, rtol=0, atol=1e-4)
    assert torch.equal(kernels.prepare(qw, float32_out=True)(x), y)
    assert torch.equal(y.bfloat16(), kernels.quant_linear(x, qw))  # the bf16 output is this, rounded once
