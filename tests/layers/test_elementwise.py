"""kvflow's fused elementwise kernels (csrc/elementwise.cpp) against the PyTorch path of the
modules that use them: RMSNorm (with and without a residual), SiluAndMul and RotaryEmbedding.

Guards:
  - each module takes the kernel when it can (checked with a spy) and its PyTorch path when the
    kernels are unavailable (`cpu_kernels.load` patched to return None, looked up at call time)
    or the input does not fit them (non-contiguous, float16);
  - float32: kernel and PyTorch path agree to ~1e-6 relative;
  - bfloat16: the kernel rounds where Hugging Face rounds (residual sum, normalised value before the
    weight, silu before `* up`, each rotary product), so it is bitwise the PyTorch path up to a tiny
    fraction of elements off by one bf16 ulp;
  - residual semantics: `out, res = norm(x, residual)` gives res = residual + x, out = norm(res);
  - rotary on row-strided q/k views of one fused QKV tensor rotates exactly the q and k columns and
    leaves v alone; `for_tensors` accepts only contiguous CPU tensors of one supported dtype.
The Hugging Face reference itself is in test_norm_rotary_hf.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.layers import cpu_kernels
from kvflow.layers.activation import SiluAndMul
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from tests.conftest import assert_nearly_bitwise


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (rows, hidden): a single decode row, a ragged width (not a multiple of 16: the scalar tail), and
# one large enough (>= 2**15 elements) that the kernels split rows across OpenMP threads.
SIZES = [pytest.param(1, 64, id="1x64"), pytest.param(7, 40, id="7x40"), pytest.param(70, 576, id="70x576")]




@pytest.fixture
def spy(kernels, monkeypatch):
    """spy("name") wraps one kernel entry point and returns the list its calls are recorded in."""

    def install(name: str) -> list[str]:
        calls: list[str] = []
        real = getattr(kernels, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(kernels, name, wrapper)
        return calls

    return install


@pytest.fixture
def no_kernels(monkeypatch):
    """Force every module onto its PyTorch path (load() is cached; patch the module attribute)."""

    def disable() -> None:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)

    return disable


# ---- for_tensors ---------------------------------------------------------------------------


def test_for_tensors_takes_only_what_the_kernels_take(kernels, monkeypatch):
    a, b = torch.randn(4, 8), torch.randn(8)
    assert cpu_kernels.for_tensors(a, b) is kernels
    assert cpu_kernels.for_tensors(a.bfloat16(), b.bfloat16()) is kernels
    assert cpu_kernels.for_tensors(a.half()) is None  # dtype the kernels do not take
    assert cpu_kernels.for_tensors(a, b.bfloat16()) is None  # mixed dtypes
    assert cpu_kernels.for_tensors(a.t(), b) is None  # non-contiguous
    assert cpu_kernels.for_tensors(a, b[::2]) is None
    assert cpu_kernels.for_tensors(torch.empty(4, 8, device="meta")) is None  # not on the CPU
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    assert cpu_kernels.for_tensors(a, b) is None  # kernels unavailable


# ---- RMSNorm -------------------------------------------------------------------------------


def make_norm(hidden: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=g))
    return norm.to(dtype).requires_grad_(False)


def norm_inputs(rows: int, hidden: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = (4 * torch.randn(rows, hidden, generator=g)).to(dtype)  # a residual stream larger than x
    return x, residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", SIZES)
def test_rms_norm_kernel_matches_torch_path(rows, hidden, dtype, spy, no_kernels):
    norm = make_norm(hidden, dtype)
    x, _ = norm_inputs(rows, hidden, dtype)
    calls = spy("add_rms_norm")
    out = norm(x)
    assert calls, "RMSNorm did not take the kernel"
    no_kernels()
    expected = norm(x)
    assert len(calls) == 1, "RMSNorm took the kernel after cpu_kernels.load was patched to None"
    assert_nearly_bitwise(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", SIZES)
def test_add_rms_norm_kernel_matches_torch_path(rows, hidden, dtype, spy, no_kernels):
    norm = make_norm(hidden, dtype)
    x, residual = norm_inputs(rows, hidden, dtype)
    calls = spy("add_rms_norm")
    out, res = norm(x, residual.clone())
    assert calls, "RMSNorm with a residual did not take the kernel"
    no_kernels()
    expected_out, expected_res = norm(x, residual.clone())
    assert len(calls) == 1
    # The sum is one rounding of an exact float32 add on both paths: bitwise in both dtypes.
    assert torch.equal(res, expected_res)
    assert_nearly_bitwise(out, expected_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_residual_semantics(dtype, spy):
    """res is residual + x (rounded to the dtype, updated in place), out is norm(res) alone."""
    norm = make_norm(576, dtype)
    x, residual = norm_inputs(5, 576, dtype)
    stream = residual.clone()
    calls = spy("add_rms_norm")
    out, res = norm(x, stream)
    assert calls
    assert res is stream, "the kernel path updates the caller's residual in place and returns it"
    assert torch.equal(res, residual + x)
    assert torch.equal(out, norm(residual + x))  # same kernel, no residual: the norm of the sum
    # In float32, straight from the definition.
    if dtype == torch.float32:
        s = (residual + x).double()
        ref = norm.weight.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + norm.eps)
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


def test_rms_norm_falls_back_for_inputs_the_kernel_cannot_take(spy):
    calls = spy("add_rms_norm")
    norm = make_norm(64, torch.float32)
    x, residual = norm_inputs(6, 64, torch.float32)
    strided = torch.randn(6, 128)[:, ::2]  # non-contiguous rows
    strided.copy_(x)
    out, res = norm(strided, residual.clone())
    assert not calls, "a non-contiguous input must take the PyTorch path"
    torch.testing.assert_close(res, residual + x, rtol=0, atol=0)
    torch.testing.assert_close(out, norm(res), rtol=1e-6, atol=1e-6)  # (this one through the kernel)
    half = make_norm(64, torch.float16)
    norm_half = half(x.half())
    assert len(calls) == 1 and norm_half.dtype == torch.float16


# ---- SiluAndMul ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", SIZES)
def test_silu_and_mul_kernel_matches_torch_path(rows, inter, dtype, spy, no_kernels):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (3 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    gate_up[0, :4] = torch.tensor([-80.0, -30.0, 30.0, 0.0])  # near-saturated exponentials and zero
    act = SiluAndMul()
    calls = spy("silu_and_mul")
    out = act(gate_up)
    assert calls and out.shape == (rows, inter)
    no_kernels()
    expected = act(gate_up)
    assert len(calls) == 1
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(expected, F.silu(gate) * up)  # the PyTorch path is the reference formula
    assert_nearly_bitwise(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_saturates(dtype):
    """Gates whose e^-g overflows float32 (g < -88.7): silu is (nearly) -0, whichever loop runs
    (16-lane vector loop for the first 16 columns, scalar tail for the rest). The vector loop clamps
    its exponent at 88, so it returns ~g * e^-88 (below 1e-35) where PyTorch returns -0."""
    gate = torch.tensor([-1e4, -200.0, -120.0, -89.0, 89.0, 120.0, 200.0, 1e4] * 3)  # 24 = 16 + 8 tail
    gate_up = torch.cat([gate, torch.full_like(gate, 2.0)])[None].to(dtype)
    out = SiluAndMul()(gate_up)
    expected = F.silu(gate_up[:, :24]) * gate_up[:, 24:]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected.double(), rtol=0, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_avx2_gives_the_avx512_bits(kernels, dtype):
    """Without AVX-512, SiLU·up runs 8 lanes at a time with exp_ref8, exp512's operations: the
    same bits as the (emulated) AVX-512 kernel, saturated, zero, subnormal and NaN gates, tails
    of 1-15 columns included."""
    if kernels.avx512f:
        pytest.skip("this CPU runs the AVX-512 loop itself")
    emulated = cpu_kernels.load_emulated_avx512()
    g = torch.Generator().manual_seed(7)
    for inter in (8, 24, 61, 576):
        gate_up = (4 * torch.randn(5, 2 * inter, generator=g)).to(dtype)
        gate_up[0, :8] = torch.tensor([-1e4, -120.0, -88.5, -0.0, 0.0, 1e-40, float("nan"), 90.0])
        got, expected = kernels.silu_and_mul(gate_up), emulated.silu_and_mul(gate_up)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(got.view(bits), expected.view(bits)), inter


def test_silu_and_mul_3d_and_non_contiguous(spy):
    calls = spy("silu_and_mul")
    gate_up = torch.randn(2, 3, 80)
    act = SiluAndMul()
    out = act(gate_up)
    assert calls and out.shape == (2, 3, 40)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    strided = torch.randn(2, 3, 160)[..., ::2]
    torch.testing.assert_close(act(strided), F.silu(strided[..., :40]) * strided[..., 40:], rtol=0, atol=0)
    assert len(calls) == 1, "a non-contiguous input must take the PyTorch path"


# ---- RotaryEmbedding -----------------------------------------------------------------------

HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, MAX_POS = 64, 6, 2, 4096


def mixed_positions(seed: int = 0) -> torch.Tensor:
    """A step's positions: two decodes far into their sequences, then a chunk from 0 and one later."""
    g = torch.Generator().manual_seed(seed)
    decodes = torch.randint(100, MAX_POS, (2,), generator=g)
    return torch.cat([decodes, torch.arange(0, 9), torch.arange(1000, 1013)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024}],
                         ids=["default", "llama3"])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 24])  # 24: half a head is 8 lanes and a scalar tail
def test_rotary_kernel_matches_torch_path(dtype, scaling, head_dim, spy, no_kernels):
    rotary = RotaryEmbedding(head_dim, MAX_POS, 10000.0, scaling).to(dtype)  # cos/sin tables cast too
    positions = mixed_positions()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(positions), NUM_HEADS, head_dim, generator=g).to(dtype)
    k = torch.randn(len(positions), NUM_KV_HEADS, head_dim, generator=g).to(dtype)
    calls = spy("rotary_")
    q_kernel, k_kernel = rotary(positions, q.clone(), k.clone())
    assert calls, "RotaryEmbedding did not take the kernel"
    no_kernels()
    q_torch, k_torch = rotary(positions, q.clone(), k.clone())
    assert len(calls) == 1, "RotaryEmbedding must look the kernels up at call time"
    # The PyTorch path needs only one rounding per op, so bf16 agrees bitwise, not just nearly.
    assert_nearly_bitwise(q_kernel, q_torch, max_fraction=0.0 if dtype == torch.bfloat16 else 1e-3)
    assert_nearly_bitwise(k_kernel, k_torch, max_fraction=0.0 if dtype == torch.bfloat16 else 1e-3)


def test_rotary_is_a_rotation_by_position():
    """float32 from the definition: pairs (i, i + D/2) rotated by position * theta^(-2i/D)."""
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, None)
    positions = mixed_positions(seed=3)
    q = torch.randn(len(positions), NUM_HEADS, HEAD_DIM)
    k = torch.randn(len(positions), NUM_KV_HEADS, HEAD_DIM)
    expected = []
    for x in (q, k):
        x64, half = x.double(), HEAD_DIM // 2
        inv_freq = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
        angle = (positions.double()[:, None] * inv_freq.float().double())[:, None, :]  # the float32 frequencies
        c, s = angle.cos(), angle.sin()
        a, b = x64[..., :half], x64[..., half:]
        expected.append(torch.cat([a * c - b * s, b * c + a * s], dim=-1))
    q_out, k_out = rotary(positions, q.clone(), k.clone())
    # float32 angles up to 4096 rad carry ~2e-4 absolute error of their own; the rotation does not add to it.
    torch.testing.assert_close(q_out.double(), expected[0], rtol=0, atol=1e-3)
    torch.testing.assert_close(k_out.double(), expected[1], rtol=0, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_fused_qkv_views_rotates_only_q_and_k(dtype, spy, no_kernels):
    """q and k as row-strided views into [T, (H + 2 KVH) * D]: rotated in place, v columns untouched."""
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, None)
    positions = mixed_positions(seed=5)
    tokens, q_size, kv_size = len(positions), NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(tokens, q_size + 2 * kv_size).to(dtype)
    original = qkv.clone()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(tokens, NUM_HEADS, HEAD_DIM), k.view(tokens, NUM_KV_HEADS, HEAD_DIM)
    assert not q.is_contiguous() and q.stride(0) == q_size + 2 * kv_size

    calls = spy("rotary_")
    q_out, k_out = rotary(positions, q, k)
    assert calls, "row-strided q/k views must take the kernel"
    assert q_out.data_ptr() == qkv.data_ptr(), "the kernel rotates in place, inside the fused tensor"

    no_kernels()
    q_ref, k_ref = rotary(positions, original[:, :q_size].reshape(tokens, NUM_HEADS, HEAD_DIM),
                          original[:, q_size : q_size + kv_size].reshape(tokens, NUM_KV_HEADS, HEAD_DIM))
    assert_nearly_bitwise(qkv[:, :q_size].reshape(q_ref.shape), q_ref, max_fraction=0.0 if dtype == torch.bfloat16 else 1e-3)
    assert_nearly_bitwise(qkv[:, q_size : q_size + kv_size].reshape(k_ref.shape), k_ref,
                        max_fraction=0.0 if dtype == torch.bfloat16 else 1e-3)
    assert torch.equal(qkv[:, q_size + kv_size :], original[:, q_size + kv_size :]), "v was modified"


def test_rotary_falls_back_for_heads_that_are_not_contiguous(spy):
    """q stored heads-major ([H, T, D] transposed): the kernel cannot take it, the PyTorch path can."""
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, None)
    positions = mixed_positions(seed=7)
    q = torch.randn(NUM_HEADS, len(positions), HEAD_DIM).transpose(0, 1)
    k = torch.randn(len(positions), NUM_KV_HEADS, HEAD_DIM)
    calls = spy("rotary_")
    q_out, k_out = rotary(positions, q, k.clone())
    assert not calls
    q_ref, k_ref = rotary(positions, q.contiguous(), k.clone())  # through the kernel
    assert len(calls) == 1
    torch.testing.assert_close(q_out, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-6, atol=1e-6)


def test_rotary_kernel_rejects_bad_inputs(kernels):
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, None)
    q, k, positions = torch.randn(3, 2, HEAD_DIM), torch.randn(3, 1, HEAD_DIM), torch.arange(3)
    with pytest.raises(ValueError, match="float32 cos/sin"):
        kernels.rotary_(q, k, positions.int(), rotary.cos_f32, rotary.sin_f32)
    with pytest.raises(ValueError, match="float32 cos/sin"):
        kernels.rotary_(q, k, positions, rotary.cos_f32.bfloat16(), rotary.sin_f32.bfloat16())
    with pytest.raises(ValueError, match="one dtype"):
        kernels.rotary_(q, k.bfloat16(), positions, rotary.cos_f32, rotary.sin_f32)
    with pytest.raises(ValueError, match="unsupported input"):  # odd head_dim
        kernels.rotary_(torch.randn(3, 2, 5), torch.randn(3, 1, 5), positions, torch.ones(8, 5), torch.ones(8, 5))


def test_rotary_kernel_rejects_positions_past_the_table(kernels):
    rotary = RotaryEmbedding(64, 16, 10000.0, None)
    with pytest.raises(IndexError):
        rotary(torch.tensor([16]), torch.randn(1, 2, 64), torch.randn(1, 1, 64))
