"""GPTQ-format checkpoints (qweight / qzeros / scales / g_idx) run as shipped.

Checked against the producer itself where it is installed (gptqmodel, which `make test` installs
without its dependencies, since it pins a newer torch than kvflow): gptq_producer.py quantizes a
tiny Llama with real GPTQ and saves it with `GPTQModel.save`, in a child process, and dumps
gptqmodel's own dequantization of what it saved. Then

- every linear's `QuantizedWeight.dequantize()` equals gptqmodel's `dequantize_weight()` of the
  saved tensors bit for bit (float16 scales: q * s and -zero * s are exact in float32, and so is
  their sum, which is exactly scale * (q - zero)), for v1 and v2 zero points, 4 and 8 bits,
  groups and per channel; and so do weights gptqmodel packed with zero points of 0 (a v1 zero of
  0 borrows from its word's next field);
- greedy decoding equals transformers running gptqmodel's dequantized weights (conftest's tie rule);
- a desc_act checkpoint (act-order g_idx) gptqmodel wrote is refused at start-up.

Without gptqmodel those tests skip, and the same checks run on checkpoints this file packs itself
from the documented layout (round-to-nearest, numpy bit operations, nothing shared with kvflow's
unpacking), with the refusals of every setting the kernel cannot run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.layers.linear import Linear
from kvflow.loader import iter_weights, resolve_quantization
from kvflow.quantization.gptq import GPTQConfig, to_quantized_weight
from kvflow.quantization.qweight import QuantizedWeight
from tests.conftest import _tiny_config, assert_greedy_match, hf_greedy, save_random_model

REPO = Path(__file__).resolve().parents[2]
HAS_PRODUCER = importlib.util.find_spec("gptqmodel") is not None
needs_producer = pytest.mark.skipif(not HAS_PRODUCER, reason="gptqmodel is not installed (make test installs it "
                                    "with --no-deps; see the Makefile)")
PRODUCED = ("w4_g32_asym_v1", "w4_g32_sym_v1", "w4_g32_asym_v2", "w4_channel_sym_v1", "w8_g32_asym_v1")
PROMPTS = [[1, 17, 42, 99, 3, 250], [5, 6, 7], list(range(2, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
ENGINE = dict(dtype="float32", kv_cache_memory=16 << 20, max_model_len=256)


# ---- checkpoints gptqmodel made ------------------------------------------------------------

@pytest.fixture(scope="session")
def produced(tmp_path_factory) -> Path:
    if not HAS_PRODUCER:
        pytest.skip("gptqmodel is not installed")
    out = tmp_path_factory.mktemp("gptqmodel")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(REPO)}
    # cwd: gptqmodel writes a logs/ folder into the working directory
    run = subprocess.run([sys.executable, "-m", "tests.quantization.gptq_producer", str(out)], cwd=out, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"gptqmodel failed to make the checkpoints:\n{(run.stdout + run.stderr)[-4000:]}"
    return out


def _quantized(path) -> dict[str, QuantizedWeight]:
    return {n: t for n, t in iter_weights(str(path), keep_quantized=lambda _: True) if isinstance(t, QuantizedWeight)}


@needs_producer
@pytest.mark.parametrize("name", PRODUCED)
def test_weights_equal_the_producers_dequantization(produced, name):
    reference = load_file(str(produced / f"{name}.reference.safetensors"))
    quantized = _quantized(produced / name)
    assert set(quantized) == set(reference) and len(reference) == 2 * 7
    bits = 8 if name.startswith("w8") else 4
    for hf_name, qw in quantized.items():
        assert qw.bits == bits and qw.source == f"gptq:W{bits}A16"
        assert qw.group_size == (qw.in_features if "channel" in name else 32)
        assert torch.equal(qw.dequantize(), reference[hf_name]), hf_name


@needs_producer
@pytest.mark.parametrize("bits", [4, 8])
def test_v1_zero_points_of_zero_as_the_producer_packs_them(produced, bits):
    """gptqmodel stores v1 zero points as the packed word minus 0x11111111 (4-bit): a zero of 0
    borrows from the next field. Undoing it field by field would corrupt those neighbours."""
    t = load_file(str(produced / f"packed_w{bits}.safetensors"))
    config = GPTQConfig.from_hf({"quant_method": "gptq", "bits": bits, "group_size": 32, "sym": False})
    qw = to_quantized_weight("packed", {p: t[p] for p in ("qweight", "qzeros", "scales", "g_idx")}, config)
    exact = (t["q"] - t["zero"].repeat_interleave(32, 1)).double() * t["scale"].double().repeat_interleave(32, 1)
    assert torch.equal(qw.dequantize().double(), exact)
    fieldwise = (_unpack_reference(t["qzeros"].numpy(), bits).astype(np.int64) + 1) % (1 << bits)
    assert not np.array_equal(fieldwise.T, t["zero"].numpy()), "the borrow case was not exercised"


@needs_producer
@pytest.mark.parametrize("name", PRODUCED)
def test_greedy_matches_transformers_on_the_producers_weights(produced, name):
    reference = load_file(str(produced / f"{name}.reference.safetensors"))
    check_engine_against_transformers(str(produced / name), reference, f"gptq:W{8 if 'w8' in name else 4}A16")


@needs_producer
def test_the_producers_desc_act_checkpoint_is_refused(produced):
    qc = json.loads((produced / "w4_g32_desc_act" / "config.json").read_text())["quantization_config"]
    assert qc["desc_act"] is True
    with pytest.raises(ValueError, match=r"g_idx: .*desc_act.*only desc_act false"):
        LLM(str(produced / "w4_g32_desc_act"), **ENGINE)


@needs_producer
def test_quantization_none_dequantizes_the_producers_checkpoint(produced):
    path = str(produced / "w4_g32_asym_v1")
    assert resolve_quantization(path, None).method == "gptq"
    assert resolve_quantization(path, None, dtype="float32").describe() == "gptq (W4A16, groups of 32, as shipped)"
    assert resolve_quantization(path, "none") is None
    floats = dict(iter_weights(path))
    reference = load_file(str(produced / "w4_g32_asym_v1.reference.safetensors"))
    for hf_name, weight in reference.items():
        assert torch.equal(floats[hf_name], weight), hf_name


def check_engine_against_transformers(path: str, linears: dict[str, torch.Tensor], source: str,
                                      quantized_head: bool = False) -> None:
    """kvflow's greedy tokens on the checkpoint as shipped == transformers' on `linears` (the
    dequantized weights) plus the checkpoint's float tensors."""
    import transformers

    state = {n: t.float() for n, t in load_file(str(Path(path) / "model.safetensors")).items()
             if n.rsplit(".", 1)[-1] not in ("qweight", "qzeros", "scales", "g_idx")}
    state.update(linears)
    hf = transformers.AutoModelForCausalLM.from_config(_tiny_config("llama"), torch_dtype=torch.float32).eval()
    hf.load_state_dict(state, strict=True)
    llm = LLM(path, **ENGINE)
    assert llm.engine.quantization.method == "gptq"
    model = llm.engine.runner.model
    sources = {n: (m.quant_weight.source if m.quant_weight is not None else None)
               for n, m in model.named_modules() if isinstance(m, Linear)}
    assert sources.pop("lm_head") == (source if quantized_head else None)
    assert set(sources.values()) == {source}, sources
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, gaps, _ = hf_greedy(hf, prompt, GREEDY.max_tokens)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"{path} {prompt[:4]}")


# ---- checkpoints packed here from the documented layout --------------------------------------

def _pack_reference(values: np.ndarray, bits: int) -> np.ndarray:
    """uint values [R, C] -> int32 [R, C * bits / 32]: field j of a word in bits [j*bits, (j+1)*bits)."""
    per = 32 // bits
    words = np.zeros((values.shape[0], values.shape[1] // per), dtype=np.uint32)
    for j in range(per):
        words |= values[:, j::per].astype(np.uint32) << np.uint32(bits * j)
    return words.view(np.int32)


def _unpack_reference(words: np.ndarray, bits: int) -> np.ndarray:
    per, mask = 32 // bits, (1 << bits) - 1
    u = words.view(np.uint32)
    out = np.zeros((u.shape[0], u.shape[1] * per), dtype=np.uint32)
    for j in range(per):
        out[:, j::per] = (u >> np.uint32(bits * j)) & np.uint32(mask)
    return out


def gptq_tensors(w: torch.Tensor, bits: int, group: int | None, sym: bool, v1: bool) -> tuple[dict, torch.Tensor]:
    """Round-to-nearest GPTQ tensors of a float weight [N, K] with float16 scales, and the weight
    they stand for, scale * (q - zero), computed in float64."""
    n, k = w.shape
    group = group or k
    maxq = (1 << bits) - 1
    g = w.double().view(n, k // group, group)
    if sym:
        scale = (g.abs().amax(-1) / ((maxq + 1) / 2 - 0.5)).half().double()
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((high - low) / maxq).half().double()
        zero = torch.round(-low / scale).clamp(0, maxq)
    q = (torch.round(g / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, maxq)
    exact = ((q - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).view(n, k)
    qzeros = _pack_reference(zero.t().numpy().astype(np.uint32), bits)
    if v1:  # stored minus one per field, as one subtraction on the word
        qzeros = (qzeros.view(np.uint32) - np.uint32(0x11111111 if bits == 4 else 0x01010101)).view(np.int32)
    tensors = {"qweight": torch.from_numpy(_pack_reference(q.view(n, k).numpy().astype(np.uint32), bits).T.copy()),
               "qzeros": torch.from_numpy(qzeros), "scales": scale.t().half().contiguous(),
               "g_idx": torch.arange(k, dtype=torch.int32) // group}
    return tensors, exact.float()


def make_checkpoint(directory: Path, bits: int = 4, group: int | None = 32, sym: bool = False, v1: bool = True,
                    lm_head: bool = False, config_edits: dict | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    """A tiny random Llama in GPTQ format, `config_edits` written over its quantization_config;
    returns (path, the dequantized linear weights)."""
    path, hf = save_random_model(_tiny_config("llama"), directory)
    state = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    out, weights = {}, {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if name.endswith("_proj.weight") or (lm_head and name == "lm_head.weight"):
            tensors, weights[name] = gptq_tensors(tensor, bits, group, sym, v1)
            out.update({f"{module}.{part}": t for part, t in tensors.items()})
        else:
            out[name] = tensor.contiguous()
    save_file(out, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group or -1, "sym": sym,
                                     "desc_act": False, "lm_head": lm_head, "true_sequential": True,
                                     "checkpoint_format": "gptq" if v1 else "gptq_v2", **(config_edits or {})}
    (Path(path) / "config.json").write_text(json.dumps(config))
    return path, weights


@pytest.mark.parametrize("bits,group,sym,v1", [(4, 32, False, True), (4, 32, True, True), (4, None, False, False),
                                               (8, 32, False, True), (8, None, True, False)])
def test_packed_here_weights_are_exact(tmp_path, bits, group, sym, v1):
    path, exact = make_checkpoint(tmp_path, bits, group, sym, v1)
    quantized = _quantized(path)
    assert set(quantized) == set(exact)
    for name, qw in quantized.items():
        assert torch.equal(qw.dequantize(), exact[name]), name


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_here_greedy_matches_transformers(tmp_path, bits):
    path, exact = make_checkpoint(tmp_path, bits, lm_head=True)
    check_engine_against_transformers(path, exact, f"gptq:W{bits}A16", quantized_head=True)


def test_quantization_none_and_the_other_modes(tmp_path, smollm2_gguf):
    path, exact = make_checkpoint(tmp_path / "gptq")
    assert resolve_quantization(path, "gptq").bits == 4
    assert resolve_quantization(path, "none") is None
    floats = dict(iter_weights(path))
    assert all(torch.equal(floats[n], w) for n, w in exact.items())
    for method in ("int8", "int4", "gguf", "compressed-tensors"):
        with pytest.raises(ValueError, match=f"quantization: {method} .*(gptq|GGUF)"):
            resolve_quantization(path, method)
    with pytest.raises(ValueError, match="quantization_group_size does not apply to gptq"):
        resolve_quantization(path, "gptq", group_size=32)
    float_path, _ = save_random_model(_tiny_config("llama"), tmp_path / "float")
    with pytest.raises(ValueError, match="gptq quantization_config, and .* has none"):
        resolve_quantization(float_path, "gptq")
    with pytest.raises(ValueError, match="is a GGUF file"):
        resolve_quantization(smollm2_gguf, "gptq")


REFUSED = {
    "bits": ({"bits": 3}, r"quantization_config.bits: 3 is not supported; choose one of 4, 8"),
    "checkpoint_format": ({"checkpoint_format": "marlin"}, r"checkpoint_format: 'marlin' .* gptq, gptq_v2"),
    "group_size": ({"group_size": 16}, r"group_size: 16 .* -1 \(per channel\) or a multiple of 32"),
    "dynamic": ({"dynamic": {"-:.*lm_head": {}}}, r"quantization_config.dynamic"),
    "pack_dtype": ({"pack_dtype": "int16"}, r"pack_dtype: 'int16'"),
}


@pytest.mark.parametrize("setting", list(REFUSED))
def test_unsupported_settings_are_refused_at_start_up(tmp_path, setting):
    edits, message = REFUSED[setting]
    path, _ = make_checkpoint(tmp_path, config_edits=edits)
    with pytest.raises(ValueError, match=message):
        LLM(path, **ENGINE)


def test_act_order_g_idx_is_refused_and_a_trivial_one_accepted(tmp_path):
    path, _ = make_checkpoint(tmp_path / "trivial", config_edits={"desc_act": True})  # desc_act, but groups in order
    assert len(_quantized(path)) == 14
    path, _ = make_checkpoint(tmp_path / "permuted", config_edits={"desc_act": True})
    file = Path(path) / "model.safetensors"
    tensors = load_file(str(file))
    g_idx = tensors["model.layers.1.self_attn.o_proj.g_idx"]
    order = torch.randperm(g_idx.numel(), generator=torch.Generator().manual_seed(0))
    tensors["model.layers.1.self_attn.o_proj.g_idx"] = g_idx[order]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"o_proj.g_idx: .*desc_act=True.*supported"):
        LLM(path, **ENGINE)


def test_an_incomplete_layer_is_refused(tmp_path):
    path, _ = make_checkpoint(tmp_path)
    file = Path(path) / "model.safetensors"
    tensors = {n: t for n, t in load_file(str(file)).items() if n != "model.layers.0.mlp.up_proj.scales"}
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="GPTQ layer model.layers.0.mlp.up_proj has only g_idx, qweight, qzeros"):
        list(iter_weights(path, keep_quantized=lambda _: True))


def test_unpack_matches_the_reference_packer():
    from kvflow.quantization.gptq import pack_int32, unpack_int32

    rng = np.random.default_rng(0)
    for bits in (4, 8):
        values = rng.integers(0, 1 << bits, (5, 64)).astype(np.uint32)
        words = torch.from_numpy(_pack_reference(values, bits))
        assert torch.equal(unpack_int32(words, bits), torch.from_numpy(values.astype(np.uint8)))
        assert torch.equal(pack_int32(torch.from_numpy(values.astype(np.int64)), bits), words)
