"""compressed-tensors checkpoints (W4A16 / W8A16) run as shipped, checked against the
compressed-tensors library itself: the checkpoints are made with its own API (apply a scheme,
compute the scales with its `calculate_qparams`, compress with `ModelCompressor`), and the
reference weights are its own decompression of the saved tensors.

- every linear's `QuantizedWeight.dequantize()` equals the library's decompressed weight:
  exactly for symmetric 8-bit (q * scale, one rounding either way); within one float32 ulp
  of the group's largest term (16 * scale for 4-bit, 256 * scale for asymmetric 8-bit) where
  kvflow's q' * scale + offset rounds twice and the library's (q - zp) * scale once; with
  bf16 scales (what producers ship) both products are exact, so the weights are bit for bit;
- greedy decoding equals transformers running the decompressed weights, token for token
  (conftest's tie rule: only the summation order differs);
- the layers really run quantized, and every unsupported setting is refused at start-up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is a test dependency (pip install .[test])")

from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.base import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from safetensors import safe_open  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.layers.linear import Linear  # noqa: E402
from kvflow.loader import iter_weights, resolve_quantization  # noqa: E402
from kvflow.quantization.compressed_tensors import CompressedTensorsConfig, unpack_int32  # noqa: E402
from kvflow.quantization.qweight import QuantizedWeight  # noqa: E402
from tests.conftest import _tiny_config, assert_greedy_match, hf_greedy, save_random_model  # noqa: E402

# name -> (num_bits, strategy, group_size, symmetric, format)
SCHEMES = {
    "w4a16_g32_sym": (4, "group", 32, True, "pack-quantized"),
    "w4a16_g32_asym": (4, "group", 32, False, "pack-quantized"),
    "w8a16_channel_sym": (8, "channel", None, True, "pack-quantized"),
    "w8a16_g32_asym": (8, "group", 32, False, "pack-quantized"),
    "w4a16_channel_asym": (4, "channel", None, False, "pack-quantized"),
    "w8a16_channel_naive": (8, "channel", None, True, "naive-quantized"),
    "w8a16_g32_asym_int": (8, "group", 32, False, "int-quantized"),
    "w4a16_g32_asym_naive": (4, "group", 32, False, "naive-quantized"),
}
PROMPTS = [[1, 17, 42, 99, 3, 250], [5, 6, 7], list(range(2, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)


def make_checkpoint(directory: Path, bits: int, strategy: str, group_size: int | None, symmetric: bool, fmt: str,
                    scale_dtype: torch.dtype = torch.float32, ignore: tuple[str, ...] = ("lm_head",)):
    """A tiny random Llama quantized and saved by compressed-tensors; returns (path, its scheme, float model)."""
    path, hf = save_random_model(_tiny_config("llama"), directory / "float")
    args = QuantizationArgs(num_bits=bits, type="int", strategy=strategy, group_size=group_size, symmetric=symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)),
                              show_progress=False)
    for module in hf.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.detach()
        w = w.unflatten(-1, (-1, group_size)) if strategy == "group" else w.unsqueeze(1)
        scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), args)
        module.weight_scale.data = scale.to(scale_dtype).reshape(module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(hf, fmt)
    compressor.compress_model(hf)
    out = directory / "quantized"
    hf.save_pretrained(out)
    compressor.update_config(out)
    return str(out), scheme


def library_decompressed(path: str, scheme: QuantizationScheme, fmt: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, each quantized layer's weight as the library decompresses it."""
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith("weight_scale")}
    out = {n: t for n, t in tensors.items() if n.rsplit(".", 1)[0] not in modules}
    compressor = BaseCompressor.get_value_from_registry(fmt)
    for module in modules:
        local = {n.rsplit(".", 1)[1]: t for n, t in tensors.items() if n.rsplit(".", 1)[0] == module}
        out[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    return out


@pytest.fixture(scope="module", params=list(SCHEMES))
def checkpoint(request, tmp_path_factory):
    bits, strategy, group, symmetric, fmt = SCHEMES[request.param]
    path, scheme = make_checkpoint(tmp_path_factory.mktemp(request.param), bits, strategy, group, symmetric, fmt)
    return request.param, path, scheme, fmt


def ulp_bound(qw: QuantizedWeight) -> torch.Tensor:
    """One float32 ulp of the largest term either dequantization rounds (per element)."""
    largest = (2 ** qw.bits) * qw.scales.abs().repeat_interleave(qw.group_size, dim=1)
    if qw.offsets is not None:
        largest = torch.maximum(largest, qw.offsets.abs().repeat_interleave(qw.group_size, dim=1))
    return largest * torch.finfo(torch.float32).eps


def test_weights_equal_the_librarys_decompression(checkpoint):
    name, path, scheme, fmt = checkpoint
    reference = library_decompressed(path, scheme, fmt)
    quantized = {n: t for n, t in iter_weights(path, keep_quantized=lambda _: True) if isinstance(t, QuantizedWeight)}
    assert len(quantized) == 2 * 7  # every linear of both layers; the LM head is in `ignore`
    bits = SCHEMES[name][0]
    worst = 0.0
    for hf_name, qw in quantized.items():
        assert qw.bits == bits and qw.source == f"compressed-tensors:W{bits}A16"
        ours, ref = qw.dequantize(), reference[hf_name]
        diff = (ours - ref).abs()
        if bits == 8 and qw.offsets is None:
            assert torch.equal(ours, ref), hf_name
        else:
            assert bool((diff <= ulp_bound(qw)).all()), f"{hf_name}: max diff {diff.max():.3g}"
        worst = max(worst, float((diff / ulp_bound(qw)).max()))
    print(f"{name}: worst difference {worst:.3f} ulp of the largest term")


def test_bf16_scales_are_bit_exact(tmp_path):
    """Producers ship bf16/fp16 scales: then q' * s and the offset are exact in float32, and so
    kvflow's weights are the library's dequantization computed in float32, bit for bit."""
    path, scheme = make_checkpoint(tmp_path, 4, "group", 32, False, "pack-quantized", scale_dtype=torch.bfloat16)
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for hf_name, qw in iter_weights(path, keep_quantized=lambda _: True):
        if not isinstance(qw, QuantizedWeight):
            continue
        module = hf_name.removesuffix(".weight")
        assert tensors[f"{module}.weight_scale"].dtype == torch.bfloat16
        n, k = tensors[f"{module}.weight_shape"].tolist()
        q = unpack_int32(tensors[f"{module}.weight_packed"], 4, k).float()
        zp = unpack_int32(tensors[f"{module}.weight_zero_point"].t().contiguous(), 4, n).t().float()
        scale = tensors[f"{module}.weight_scale"].float()
        exact = ((q.view(n, -1, 32) - zp.unsqueeze(-1)) * scale.unsqueeze(-1)).view(n, k)
        assert torch.equal(qw.dequantize(), exact), hf_name


def test_greedy_matches_transformers_on_the_decompressed_weights(checkpoint):
    name, path, scheme, fmt = checkpoint
    import transformers

    hf = transformers.AutoModelForCausalLM.from_config(_tiny_config("llama"), torch_dtype=torch.float32).eval()
    hf.load_state_dict(library_decompressed(path, scheme, fmt), strict=True)
    llm = LLM(path, dtype="float32", kv_cache_memory=16 << 20, max_model_len=256)
    model = llm.engine.runner.model
    bits = SCHEMES[name][0]
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    sources = {n: (m.quant_weight.source if m.quant_weight is not None else None) for n, m in linears.items()}
    assert sources.pop("lm_head") is None  # ignored by the checkpoint: float
    assert set(sources.values()) == {f"compressed-tensors:W{bits}A16"}, sources
    assert llm.engine.quantization.method == "compressed-tensors"
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, gaps, _ = hf_greedy(hf, prompt, GREEDY.max_tokens)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"{name} {prompt[:4]}")


def test_a_quantized_lm_head_runs_quantized(tmp_path):
    import transformers

    path, scheme = make_checkpoint(tmp_path, 4, "group", 32, False, "pack-quantized", ignore=())
    hf = transformers.AutoModelForCausalLM.from_config(_tiny_config("llama"), torch_dtype=torch.float32).eval()
    hf.load_state_dict(library_decompressed(path, scheme, "pack-quantized"), strict=True)
    llm = LLM(path, dtype="float32", kv_cache_memory=16 << 20, max_model_len=256)
    assert llm.engine.runner.model.lm_head.quant_weight.source == "compressed-tensors:W4A16"
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
    ref, gaps, _ = hf_greedy(hf, PROMPTS[0], GREEDY.max_tokens)
    assert_greedy_match(out.outputs[0].token_ids, ref, gaps, "quantized head")


def test_quantization_none_dequantizes_and_int8_is_refused(checkpoint):
    name, path, _, _ = checkpoint
    assert resolve_quantization(path, None).method == "compressed-tensors"
    assert resolve_quantization(path, None, dtype="float32").method == "compressed-tensors"
    assert resolve_quantization(path, "compressed-tensors").bits == SCHEMES[name][0]
    assert resolve_quantization(path, "none") is None
    for method in ("int8", "int4", "gguf"):
        with pytest.raises(ValueError, match="quantization: "):
            resolve_quantization(path, method)
    floats = dict(iter_weights(path))  # no keep_quantized: dequantized to float32
    assert all(not isinstance(t, QuantizedWeight) for t in floats.values())
    assert floats["model.layers.0.mlp.down_proj.weight"].shape == (64, 160)


def _w4a16(**weights) -> dict:
    args = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True, **weights}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}, "ignore": ["lm_head"]}


REFUSED = {
    "input_activations": (lambda c: c["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}), "activation"),
    "float8": (lambda c: c["config_groups"]["group_0"]["weights"].update(type="float", num_bits=8), "'int'"),
    "num_bits": (lambda c: c["config_groups"]["group_0"]["weights"].update(num_bits=3), "4, 8"),
    "strategy": (lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "group, channel"),
    "group_size": (lambda c: c["config_groups"]["group_0"]["weights"].update(group_size=16), "multiples of 32"),
    "actorder": (lambda c: c["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder"),
    "format": (lambda c: c.update(format="float-quantized"), "pack-quantized"),
    "sparsity": (lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
                 "sparsity"),
    "kv_cache": (lambda c: c.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "KV cache"),
    "status": (lambda c: c.update(quantization_status="frozen"), "compressed"),
}


@pytest.mark.parametrize("setting", list(REFUSED))
def test_unsupported_settings_are_refused_at_start_up(setting, tmp_path):
    edit, message = REFUSED[setting]
    qc = _w4a16()
    CompressedTensorsConfig.from_hf(qc)  # the base config is accepted
    edit(qc)
    with pytest.raises(ValueError, match=message):
        CompressedTensorsConfig.from_hf(qc)
    save_random_model(_tiny_config("llama"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, max_model_len=256)


def test_an_incomplete_layer_is_refused(tmp_path):
    from safetensors.torch import save_file

    path, _ = make_checkpoint(tmp_path, 4, "group", 32, True, "pack-quantized")
    file = Path(path) / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if n != "model.layers.1.mlp.up_proj.weight_scale"}
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj has only weight_packed, weight_shape"):
        list(iter_weights(path, keep_quantized=lambda _: True))


def test_unpack_matches_the_librarys_packing():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    torch.manual_seed(0)
    for bits in (4, 8):
        low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        q = torch.randint(low, high + 1, (6, 96), dtype=torch.int8)
        assert torch.equal(unpack_int32(pack_to_int32(q, bits), bits, 96), q)
        zp = torch.randint(low, high + 1, (40, 3), dtype=torch.int8)  # zero points pack along rows
        packed = pack_to_int32(zp, bits, packed_dim=0)
        assert torch.equal(unpack_int32(packed.t().contiguous(), bits, 40).t(), zp)


def test_compressed_tensors_is_refused_where_there_is_none(tmp_path, smollm2_gguf):
    path, _ = save_random_model(_tiny_config("llama"), tmp_path)
    assert resolve_quantization(path, None) is None  # a float checkpoint stays float
    with pytest.raises(ValueError, match="has none"):
        resolve_quantization(path, "compressed-tensors")
    with pytest.raises(ValueError, match="is a GGUF file"):
        resolve_quantization(smollm2_gguf, "compressed-tensors")
    with pytest.raises(ValueError, match="quantization_group_size does not apply to compressed-tensors"):
        resolve_quantization(path, "compressed-tensors", group_size=32)


@pytest.mark.parametrize("bits,group,symmetric", [(4, 64, True), (4, 128, False), (8, 128, False), (8, 64, True),
                                                   (4, None, True), (8, None, False)])
def test_one_layer_of_larger_groups(bits, group, symmetric):
    """Group sizes the tiny model cannot take (its 160 inputs), on one 48 x 256 layer."""
    from kvflow.quantization.compressed_tensors import WeightScheme, to_quantized_weight

    strategy = "group" if group else "channel"
    args = QuantizationArgs(num_bits=bits, type="int", strategy=strategy, group_size=group, symmetric=symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    torch.manual_seed(bits + (group or 0))
    w = torch.randn(48, 256) * 0.05
    grouped = w.unflatten(-1, (-1, group)) if group else w.unsqueeze(1)
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    state = {"weight": w, "weight_scale": scale.reshape(48, -1), "weight_zero_point": zero_point.reshape(48, -1)}
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    stored = compressor.compress(state, scheme)
    ours = to_quantized_weight("layer", stored, WeightScheme(bits, strategy, group, symmetric, "pack-quantized",
                                                             ("Linear",)))
    ref = compressor.decompress(stored, scheme)["weight"].float()
    assert ours.group_size == (group or 256) and ours.bits == bits
    if bits == 8 and symmetric:
        assert torch.equal(ours.dequantize(), ref)
    else:
        assert bool(((ours.dequantize() - ref).abs() <= ulp_bound(ours)).all())
