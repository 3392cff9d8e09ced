"""Mixture-of-experts GGUF files as llama.cpp's converter lays them out (stacked 3-D expert
tensors, routers, Qwen2-MoE's shared expert and its 1-D gate, Mixtral's permuted q/k), written
here from the tiny random transformers models and run against the same weights from the
Hugging Face directory."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from kvflow import LLM, SamplingParams
from kvflow.loader.gguf_loader import linear_weight_types, read_gguf_config

GGUF_ARCH = {"mixtral": "llama", "qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe"}
_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip
_EXPERT = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: rotary pairs interleaved (llama files only)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(path: str, cfg, llama: bool) -> dict[str, np.ndarray]:
    """The HF checkpoint's tensors under llama.cpp's names, each layer's experts stacked."""
    out, experts = {}, {}
    for name, w in load_file(f"{path}/model.safetensors").items():
        if name == "lm_head.weight":
            out["output.weight"] = w
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            out["token_embd.weight" if "embed" in name else "output_norm.weight"] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        part, kind = rest.rsplit(".", 1)
        if ".experts." in part:
            _, e, proj = part.rsplit(".", 2)
            experts.setdefault((layer, _EXPERT[proj]), {})[int(e)] = w
            continue
        gname = f"blk.{layer}.{_PARTS[part]}.{kind}"
        if llama and ".attn_q." in gname:
            w = _permute(w, cfg.num_attention_heads)
        elif llama and ".attn_k." in gname:
            w = _permute(w, cfg.num_key_value_heads)
        out[gname] = w.reshape(-1) if gname.endswith("ffn_gate_inp_shexp.weight") else w  # llama.cpp: 1-D
    for (layer, proj), by_expert in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_moe_gguf(path: str, out_file, arch: str, hf_config, expert_type: Q = Q.F32) -> None:
    cfg = hf_config
    writer = gguf.GGUFWriter(str(out_file), GGUF_ARCH[arch])
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    for add, value in ((writer.add_block_count, cfg.num_hidden_layers), (writer.add_context_length, 1024),
                       (writer.add_embedding_length, cfg.hidden_size),
                       (writer.add_feed_forward_length, cfg.intermediate_size),
                       (writer.add_head_count, cfg.num_attention_heads), (writer.add_head_count_kv, cfg.num_key_value_heads),
                       (writer.add_key_length, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
                       (writer.add_layer_norm_rms_eps, cfg.rms_norm_eps), (writer.add_rope_freq_base, cfg.rope_parameters["rope_theta"]),
                       (writer.add_bos_token_id, 1), (writer.add_eos_token_id, 2), (writer.add_vocab_size, cfg.vocab_size),
                       (writer.add_expert_count, experts), (writer.add_expert_used_count, cfg.num_experts_per_tok)):
        add(value)
    if arch != "mixtral":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", *(f"t{i}" for i in range(3, cfg.vocab_size))])
    writer.add_token_scores([0.0] * cfg.vocab_size)
    writer.add_token_types([2, 3, 3, *([1] * (cfg.vocab_size - 3))])
    for name, w in _tensors(path, cfg, llama=arch == "mixtral").items():
        if "_exps." in name and expert_type != Q.F32:
            writer.add_tensor(name, gguf.quants.quantize(w, expert_type), raw_dtype=expert_type)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _prompts() -> list[dict]:
    rng = np.random.default_rng(11)
    return [{"prompt_token_ids": rng.integers(3, 320, size=int(n)).tolist()} for n in (5, 19, 40, 77)]


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)  # (the HF configs lack an EOS)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe", "qwen3moe"])
def test_float_gguf_runs_bit_for_bit_as_its_checkpoint(arch, tiny_models, tmp_path):
    path, hf = tiny_models(arch)
    out = tmp_path / f"{arch}.gguf"
    write_moe_gguf(path, out, arch, hf.config)
    config = read_gguf_config(str(out))
    assert config["architectures"] == [type(hf).__name__]
    assert config["num_experts"] == 8 and config["num_experts_per_tok"] == 2
    assert config["mlp_only_layers"] == ([1] if arch == "qwen2moe" else [])
    kwargs = dict(dtype="float32", kv_cache_memory=4 << 20, max_model_len=256)
    from_gguf = LLM(str(out), **kwargs).generate(_prompts(), GREEDY, use_tqdm=False)
    from_hf = LLM(path, **kwargs).generate(_prompts(), GREEDY, use_tqdm=False)
    for a, b in zip(from_gguf, from_hf):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # the GGUF carries a tokenizer and the HF folder none: decoded_token differs, values and ranks may not
        assert [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in a.outputs[0].logprobs] == [
            {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in b.outputs[0].logprobs]


def test_quantized_experts_run_as_shipped(tiny_models, tmp_path):
    """Q8_0 expert stacks: each expert's own blocks, as shipped; the router stays float."""
    path, hf = tiny_models("mixtral")
    out = tmp_path / "mixtral-q8.gguf"
    write_moe_gguf(path, out, "mixtral", hf.config, expert_type=Q.Q8_0)
    assert linear_weight_types(str(out))["Q8_0"] == 3 * hf.config.num_hidden_layers * 8  # a weight per expert
    kwargs = dict(dtype="float32", kv_cache_memory=4 << 20, max_model_len=256)
    shipped = LLM(str(out), quantization="gguf", **kwargs)
    block = shipped.engine.runner.model.layers[0].mlp
    assert {e.gate_up_proj.quant_weight.source for e in block.experts} == {"gguf:Q8_0"}
    assert {e.down_proj.quant_weight.source for e in block.experts} == {"gguf:Q8_0"}
    assert block.gate.quant_weight is None
    dequantized = LLM(str(out), quantization="none", **kwargs)
    for ours, ref in zip(shipped.generate(_prompts(), GREEDY, use_tqdm=False),
                         dequantized.generate(_prompts(), GREEDY, use_tqdm=False)):
        a, b = ours.outputs[0], ref.outputs[0]
        i = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if i is not None:  # only at a near-tie of the float run
            top2 = sorted((lp.logprob for lp in b.logprobs[i].values()), reverse=True)[:2]
            assert top2[0] - top2[1] < 1e-3, f"diverged at step {i} away from a tie"
