"""Each quantized mode end to end: the engine's greedy output equals transformers running the
same dequantized weights, whatever the batching, chunking, prefix caching or preemption."""

from __future__ import annotations

import copy

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.quantization.methods import quantize
from tests.conftest import check_greedy_run, hf_greedy, shared_prefix_prompts

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
MODES = {"int8": ("int8", None), "int8-g32": ("int8", 32), "int4-g32": ("int4", 32)}
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dequantized_oracle(hf, method: str, group_size: int | None):
    """transformers with every linear layer (not the LM head) replaced by its dequantized
    quantization: the model a quantized engine must reproduce."""
    oracle = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in oracle.named_modules():
            if name.rsplit(".", 1)[-1] in _LINEARS:
                module.weight.copy_(quantize(module.weight, method, group_size).dequantize())
    return oracle


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(11, 10)


@pytest.fixture(scope="module", params=list(MODES))
def mode(request, tiny_models, prompts):
    path, hf = tiny_models("llama")
    method, group = MODES[request.param]
    oracle = dequantized_oracle(hf, method, group)
    return request.param, path, method, group, [hf_greedy(oracle, p, NEW_TOKENS)[:2] for p in prompts]


def _check(llm: LLM, prompts, refs, label: str, indices=None) -> None:
    check_greedy_run(llm, prompts, refs, GREEDY, label, indices)


@pytest.mark.parametrize("config", [
    dict(),
    dict(max_num_batched_tokens=16),  # prompts chunked
    dict(max_num_seqs=2, enable_prefix_caching=False),
    dict(kv_cache_memory=48 << 10),  # room for about two requests: preemption
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_matches_dequantized_transformers(mode, prompts, config):
    label, path, method, group, refs = mode
    llm = LLM(path, dtype="float32", quantization=method, quantization_group_size=group, max_model_len=96,
              **{"kv_cache_memory": 1 << 20, **config})
    assert {m.quant_weight.source for m in llm.engine.runner.model.modules()
            if getattr(m, "quant_weight", None) is not None} == {method}
    _check(llm, prompts, refs, f"{label} {config}")
    for i in (0, 11):  # alone: the same tokens as in the batch (and the prefix cache reused)
        _check(llm, prompts, refs, f"{label} alone", [i])
    if "kv_cache_memory" in config:
        assert llm.engine.get_stats().num_preemptions > 0


def test_lm_head_kept_unless_asked(tiny_models):
    path, _ = tiny_models("llama")
    plain = LLM(path, dtype="float32", quantization="int8", kv_cache_memory=1 << 20)
    assert plain.engine.runner.model.lm_head.quant_weight is None
    head = LLM(path, dtype="float32", quantization="int8", quantize_lm_head=True, kv_cache_memory=1 << 20)
    assert head.engine.runner.model.lm_head.quant_weight is not None
    out = head.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == NEW_TOKENS
    # The plan counts the quantized head (int8 per channel: a byte a weight), beside the float
    # table where it was tied, in place of the float head where it was not
    cfg = head.engine.model_config
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    untied = vocab * hidden * (0 if cfg.tie_word_embeddings else 4)
    assert head.engine.plan.weight_bytes - plain.engine.plan.weight_bytes == vocab * hidden - untied
    with pytest.raises(ValueError, match="quantize_lm_head is set but nothing is quantized"):
        LLM(path, dtype="float32", quantization="none", quantize_lm_head=True, kv_cache_memory=1 << 20)


def test_group_that_does_not_divide_a_layer_is_refused_at_start(tiny_models):
    path, _ = tiny_models("llama")  # intermediate_size 160: not whole groups of 64
    with pytest.raises(ValueError, match=r"quantization_group_size=64: layer .*down_proj has 160 inputs"):
        LLM(path, dtype="float32", quantization="int4", quantization_group_size=64, kv_cache_memory=1 << 20)


def test_gguf_needs_a_gguf_file(tiny_models):
    path, _ = tiny_models("llama")
    with pytest.raises(ValueError, match="quantization: gguf runs a GGUF file's"):
        LLM(path, dtype="float32", quantization="gguf", kv_cache_memory=1 << 20)
