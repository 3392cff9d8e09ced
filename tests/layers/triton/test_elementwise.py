"""The fused elementwise kernels of the CUDA path against the modules' PyTorch path (the one a CUDA
tensor took before them): residual add + RMSNorm, SiLU·mul, rotary on strided views into a fused
QKV output. Under the interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding, _apply
from tests.layers.triton.interpreter import DEVICE, load_kernels

load_kernels()
from kvflow.layers.triton import elementwise  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_the_module(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    norm = norm.to(dtype)
    x = torch.randn(5, 48, generator=gen).to(dtype)
    residual = torch.randn(5, 48, generator=gen).to(dtype)
    want_out, want_res = norm._norm(residual + x), residual + x
    res = residual.clone().to(DEVICE)
    out, new_res = elementwise.add_rms_norm(x.to(DEVICE), res, norm.weight.to(DEVICE), norm.eps)
    assert new_res.data_ptr() == res.data_ptr()  # updated in place
    # One rounding, as torch's add (exact in float32; the interpreter's bf16 casts may round
    # differently from a GPU's, so bf16 is held to a tolerance here).
    torch.testing.assert_close(new_res.cpu(), want_res, **(TOL[dtype] if dtype != torch.float32 else dict(atol=0, rtol=0)))
    torch.testing.assert_close(out.cpu(), want_out, **TOL[dtype])
    alone = elementwise.add_rms_norm(x.to(DEVICE), None, norm.weight.to(DEVICE), norm.eps)
    torch.testing.assert_close(alone.cpu(), norm._norm(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(dtype):
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(elementwise.silu_and_mul(gate_up.to(DEVICE)).cpu(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_fused_qkv_views(dtype):
    heads, kv_heads, dim = 4, 2, 16
    rope = RotaryEmbedding(dim, 64, 10000.0, None).to(dtype)
    qkv = torch.randn(6, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    positions = torch.tensor([0, 1, 2, 17, 40, 63])
    q = qkv[:, : heads * dim].view(6, heads, dim)
    k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(6, kv_heads, dim)
    cos = rope.cos_cache[positions].unsqueeze(1).to(dtype)
    sin = rope.sin_cache[positions].unsqueeze(1).to(dtype)
    want_q, want_k, want_v = _apply(q, cos, sin), _apply(k, cos, sin), qkv[:, (heads + kv_heads) * dim:].clone()
    qkv_d = qkv.to(DEVICE)
    qd = qkv_d[:, : heads * dim].view(6, heads, dim)
    kd = qkv_d[:, heads * dim: (heads + kv_heads) * dim].view(6, kv_heads, dim)
    elementwise.rotary_(qd, kd, positions.to(DEVICE), rope.cos_cache.to(DEVICE), rope.sin_cache.to(DEVICE))
    torch.testing.assert_close(qd.cpu(), want_q, **TOL[dtype])
    torch.testing.assert_close(kd.cpu(), want_k, **TOL[dtype])
    assert torch.equal(qkv_d[:, (heads + kv_heads) * dim:].cpu(), want_v)  # v untouched
