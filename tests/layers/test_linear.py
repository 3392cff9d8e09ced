"""kvflow.layers.linear: which packing `Linear.pack()` picks, and that packed outputs match F.linear.

Guards:
  - weights take kvflow's own GEMM when the kernels have its instructions (AVX512-BF16 for bf16,
    AVX-512F for float32), else oneDNN's prepacked weight when oneDNN is available, else plain;
  - a packed layer's output matches F.linear on the plain weight (bf16 within rounding, float32 to
    1e-5), for one row, many rows, 3-D input, with and without bias, and really runs the packed path;
  - KVFLOW_PACKED_LINEAR=0 keeps the plain weight; `pack_linear_weights` counts each packing;
  - `pack_linear_weights` packs kvflow-layout weights into one buffer per dtype, and quantized
    weights' tiles into one more, on 2 MiB pages where Linux has transparent huge pages, with
    outputs equal to packing each one alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers import cpu_kernels
from kvflow.layers.linear import Linear, pack_linear_weights
from kvflow.quantization import methods, tiles
from tests.conftest import huge_kib_under, thp_mode


def expected_packing(dtype: torch.dtype, in_features: int = 64) -> str:
    """The choice `pack()` should make on this machine, from the capabilities it depends on."""
    kernels = cpu_kernels.load()
    if kernels is not None and kernels.has_gemm(dtype) and (dtype == torch.float32 or in_features % 2 == 0):
        return "kvflow"
    if torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    ):
        return "onednn"
    return "plain"


@pytest.fixture(autouse=True)
def _packing_enabled(monkeypatch):
    monkeypatch.delenv("KVFLOW_PACKED_LINEAR", raising=False)


@pytest.fixture(scope="module", autouse=True)
def _kernels_are_built(kernels):
    """The kernels are part of the install: a broken build fails here, never silently."""


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():  # a non-trivial bias, on the scale of the product
        if bias:
            layer.bias.normal_()
    return layer


def test_bf16_packing_choice():
    layer = make_linear(64, 40, True, torch.bfloat16)
    assert layer.packing == "plain" and layer.packed_weight is None  # nothing packed until pack()
    layer.pack()
    assert layer.packing == expected_packing(torch.bfloat16)
    kernels = cpu_kernels.load()
    if kernels is not None and kernels.has_gemm_bf16:
        assert layer.packing == "kvflow"
        assert layer.packed_weight.shape == (3, 32, 16, 2)  # [ceil(40/16), K/2, 16, 2]


def test_bf16_odd_in_features_skips_kvflow_gemm():
    layer = make_linear(63, 40, True, torch.bfloat16)
    layer.pack()
    assert layer.packing == expected_packing(torch.bfloat16, in_features=63) != "kvflow"


def test_fp32_packing_choice():
    layer = make_linear(63, 40, True, torch.float32)  # float32 packs one k per lane: any K
    layer.pack()
    assert layer.packing == expected_packing(torch.float32, in_features=63)
    kernels = cpu_kernels.load()
    if kernels is not None and kernels.has_gemm_f32:
        assert layer.packing == "kvflow" and layer.packed_weight.shape == (3, 63, 16)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fp32_without_kvflow_gemm_falls_back_to_onednn(monkeypatch, bias):
    """No kernels: float32 takes oneDNN's prepacked weight, equal to F.linear up to summation order."""
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    layer = make_linear(96, 40, bias, torch.float32)
    layer.pack()
    assert layer.packing == ("onednn" if torch.backends.mkldnn.is_available() else "plain")
    x = torch.randn(2, 5, 96)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1,), (33,), (2, 5)], ids=["1row", "33rows", "3d"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_packed_output_matches_f_linear(monkeypatch, dtype, bias, shape):
    k, n = 96, 40
    layer = make_linear(k, n, bias, dtype, seed=len(shape) * 10 + shape[0])
    x = torch.randn(*shape, k).to(dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    exact = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())

    layer.pack()
    assert layer.packing == expected_packing(dtype)
    with monkeypatch.context() as mp, torch.no_grad():
        if layer.packing != "plain":  # prove the packed path ran, not the F.linear fallback
            mp.setattr(F, "linear", lambda *a, **kw: pytest.fail("packed Linear fell back to F.linear"))
        y = layer(x)

    assert y.shape == (*shape, n) and y.dtype == dtype
    if dtype == torch.bfloat16:
        # Both are the float32-accumulated product rounded to bf16: within a bf16 step of each
        # other, and each within half a step (plus float32 noise) of the exact product.
        torch.testing.assert_close(y.float(), expected.float(), rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-3)
    else:
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_forward_float32_is_the_bf16_output_widened(bias):
    """The LM head's logits (`forward_float32`) equal `.float()` of its bf16 output, whichever GEMM
    writes them (the float32-output store where AVX512-BF16 runs)."""
    layer = make_linear(64, 83, bias, torch.bfloat16)
    layer.pack()
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        logits = layer.forward_float32(x)
        assert logits.dtype == torch.float32 and torch.equal(logits, layer(x).float())
        assert torch.equal(layer.forward_float32(x[1:3]), logits[1:3])  # rows alone or batched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_packed_rows_do_not_depend_on_batch(dtype):
    """The kvflow GEMM's promise: a token's output is the same alone or batched."""
    if expected_packing(dtype) != "kvflow":
        pytest.skip(f"this CPU lacks the instructions of kvflow's {dtype} GEMM")
    layer = make_linear(96, 40, True, dtype)
    layer.pack()
    x = torch.randn(17, 96).to(dtype)
    with torch.no_grad():
        batched = layer(x)
        for i in range(x.shape[0]):
            assert torch.equal(layer(x[i : i + 1])[0], batched[i])


def test_env_forces_plain(monkeypatch):
    layer = make_linear(64, 40, True, torch.bfloat16)
    layer.pack()
    monkeypatch.setenv("KVFLOW_PACKED_LINEAR", "0")
    layer.pack()  # re-packing under the env drops any earlier packing
    assert layer.packing == "plain" and layer.packed_weight is None
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pack_linear_weights_counts(monkeypatch, dtype):
    def model():
        torch.manual_seed(0)
        # Two kvflow Linears, one plain nn.Linear (not ours: neither packed nor counted).
        return nn.Sequential(Linear(64, 32), nn.ReLU(), Linear(32, 16), nn.Linear(16, 8)).to(dtype)

    m = model()
    assert pack_linear_weights(m) == {expected_packing(dtype): 2}
    assert not hasattr(m[3], "packing")
    x = torch.randn(4, 64).to(dtype)
    with torch.no_grad():
        y = m(x)
    assert y.shape == (4, 8) and torch.isfinite(y.float()).all()

    monkeypatch.setenv("KVFLOW_PACKED_LINEAR", "0")
    assert pack_linear_weights(model()) == {"plain": 2}
    assert pack_linear_weights(nn.Sequential(nn.Linear(4, 4))) == {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pack_linear_weights_holds_each_weight_once(dtype):
    """Packed Linears drop their plain weight, unless another module shares it (a tied LM head
    is the embedding table); outputs are unchanged and packing again is a no-op."""
    if expected_packing(dtype) == "plain":
        pytest.skip("this CPU has neither kvflow's GEMM (AVX2 + FMA) nor oneDNN for this dtype: nothing is packed")
    torch.manual_seed(0)
    embed, proj, head = nn.Embedding(50, 32), Linear(32, 32), Linear(32, 50, bias=False)
    head.weight = embed.weight  # tied
    m = nn.ModuleDict({"embed": embed, "proj": proj, "head": head}).to(dtype)
    ids = torch.tensor([3, 7, 49])
    with torch.no_grad():
        proj.pack(), head.pack()  # packed but still holding the plain weights
        before = head(proj(embed(ids)))
        pack_linear_weights(m)
        assert proj.weight.device.type == "meta" and proj.weight.shape == (32, 32) and proj.weight.dtype == dtype
        assert head.weight is embed.weight and embed.weight.device.type == "cpu"
        assert pack_linear_weights(m) == {expected_packing(dtype): 2}
        assert torch.equal(head(proj(embed(ids))), before)
        other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
        with pytest.raises(TypeError, match="plain weight was released"):
            proj(torch.randn(2, 32).to(other))


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_bf16_without_kvflow_gemm_falls_back_to_onednn(monkeypatch, bias):
    """No kernels (no compiler, KVFLOW_CPU_KERNELS=0): bf16 takes oneDNN's prepacked weight, whose
    results the module docstring promises are bit-identical to F.linear."""
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    layer = make_linear(96, 40, bias, torch.bfloat16)
    layer.pack()
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        assert layer.packing == "plain"
        return
    assert layer.packing == "onednn"
    x = torch.randn(2, 5, 96).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pack_linear_weights_shares_one_huge_page_buffer(dtype):
    if expected_packing(dtype) != "kvflow":
        pytest.skip(f"this CPU lacks the instructions of kvflow's {dtype} GEMM")
    torch.manual_seed(0)
    layers = [Linear(576, 1536, bias=i == 0) for i in range(4)] + [Linear(1536, 576)]  # ~4.5 M weights
    model = nn.ModuleList(layers).to(dtype)
    alone = make_linear(576, 1536, True, dtype)  # the same weights, packed on their own
    alone.load_state_dict(layers[0].state_dict())
    alone.pack()
    pack_linear_weights(model)
    packed = [m.packed_weight for m in layers]
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1, "not one shared buffer"
    assert all(p.is_contiguous() and p.data_ptr() % 64 == 0 for p in packed)
    ends = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in packed]
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:])), "slots overlap"
    x = torch.randn(5, 576).to(dtype)
    with torch.no_grad():
        assert torch.equal(layers[0](x), alone(x))
        assert layers[4](layers[3](x)).shape == (5, 576)
    if thp_mode() in ("always", "madvise"):
        whole = torch.empty(0, dtype=dtype).set_(packed[0].untyped_storage())
        assert huge_kib_under(whole) >= 2 << 10, "the packed weights did not land on 2 MiB pages"


def test_pack_linear_weights_puts_quantized_tiles_in_one_huge_page_buffer():
    if not tiles.available():
        pytest.skip("the quantized tiles need AVX512-BF16 or AVX2 + FMA")
    torch.manual_seed(0)
    layers = [Linear(576, 1536, bias=False) for _ in range(3)] + [Linear(1536, 576, bias=False)]  # ~2.4 MB of tiles
    model = nn.ModuleList(layers).to(torch.bfloat16)
    quantized = [methods.quantize_int4(m.weight.detach().float(), 32) for m in layers[:3]]
    quantized.append(methods.quantize_int8(layers[3].weight.detach().float()))  # float32 scales beside
    alone = [tiles.prepare(tiles.pack(qw)) for qw in quantized]  # each packed on its own
    for m, qw in zip(layers, quantized):
        m.set_quantized(qw)
    assert pack_linear_weights(model) == {"quantized-tiles": 4}
    qs = [m.quant_tiles.q for m in layers]
    assert len({q.untyped_storage().data_ptr() for q in qs}) == 1, "not one shared buffer"
    assert all(q.data_ptr() % 64 == 0 for q in qs)
    x, wide = torch.randn(3, 576).to(torch.bfloat16), torch.randn(3, 1536).to(torch.bfloat16)
    with torch.no_grad():
        assert all(torch.equal(m(x), op(x)) for m, op in zip(layers[:3], alone[:3]))
        assert torch.equal(layers[3](wide), alone[3](wide))
    if thp_mode() in ("always", "madvise"):
        whole = torch.empty(0, dtype=torch.uint8).set_(qs[0].untyped_storage())
        assert huge_kib_under(whole) >= 2 << 10, "the tiles did not land on 2 MiB pages"


def test_pack_into_a_slot_of_the_wrong_shape_is_refused(kernels):
    if expected_packing(torch.float32) != "kvflow":
        pytest.skip("this CPU lacks AVX-512: no kvflow float32 GEMM")
    layer = make_linear(64, 40, False, torch.float32)
    assert layer.kvflow_packed_shape() == (3, 64, 16)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        layer.pack(torch.empty(3, 63, 16))
