"""kv_cache_dtype="int8" end to end.

The oracle is transformers with every layer's K and V (after rotary) replaced by their int8
round trip, scale = float16(max|x| / 127) per token and KV head, written out here from the
format's definition: the model an int8 KV cache must reproduce. The engine matches it
greedily in float32 and bf16 weights' float32 run, whatever the batching, chunking, prefix
caching or preemption, and every block comes back to the pool.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.engine.memory_plan import plan_kv_cache
from kvflow.layers.kv_int8 import Int8KVCache
from tests.conftest import check_greedy_run, hf_greedy, shared_prefix_prompts

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] as an int8 KV cache stores it."""
    scale = (x.float().abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale > 0, (x.float() / safe).round(), torch.zeros_like(x)).clamp(-127, 127)
    return (q * scale).to(x.dtype)


def int8_kv_oracle(hf):
    """transformers whose attention sees every key and value through the int8 round trip
    (the DynamicCache keeps the float K/V; each step quantizes them anew, to the same values)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module, query, key, value, *args, **kwargs):
        return sdpa(module, query, int8_round_trip(key), int8_round_trip(value), *args, **kwargs)

    AttentionInterface.register("kvflow_int8_kv", attention)
    oracle = copy.deepcopy(hf)
    oracle.set_attn_implementation("kvflow_int8_kv")
    return oracle


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(5, 8)


@pytest.fixture(scope="module")
def refs(tiny_models, prompts):
    path, hf = tiny_models("llama")
    oracle = int8_kv_oracle(hf)
    return path, [hf_greedy(oracle, p, NEW_TOKENS)[:2] for p in prompts]


def _check(llm: LLM, prompts, refs, label: str, indices=None) -> None:
    check_greedy_run(llm, prompts, refs, GREEDY, label, indices)


@pytest.mark.parametrize("config", [
    dict(),
    dict(max_num_batched_tokens=16),  # prompts chunked
    dict(max_num_seqs=2, enable_prefix_caching=False),
    dict(block_size=5),  # blocks that are not whole tiles of 16 keys
    dict(kv_cache_memory=16 << 10),  # 7 blocks, about one request: preemption
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_matches_transformers_over_int8_kv(refs, prompts, config):
    path, expected = refs
    llm = LLM(path, dtype="float32", kv_cache_dtype="int8", max_model_len=96, **{"kv_cache_memory": 1 << 20, **config})
    assert all(isinstance(c, Int8KVCache) for c in llm.engine.runner.kv_caches)
    _check(llm, prompts, expected, f"int8 KV {config}")
    for i in (0, 9):  # alone: the same tokens as in the batch (and the prefix cache reused)
        _check(llm, prompts, expected, "int8 KV alone", [i])
    if "kv_cache_memory" in config:
        assert llm.engine.get_stats().num_preemptions > 0


def test_pytorch_attention_path_gives_the_same_tokens(refs, prompts, monkeypatch):
    """Without the compiled kernels (KVFLOW_CPU_KERNELS=0) the same dequantized values go
    through PyTorch's attention."""
    from kvflow.layers import kv_int8

    monkeypatch.setattr(kv_int8, "kernel_supports", lambda *a: False)
    path, expected = refs
    llm = LLM(path, dtype="float32", kv_cache_dtype="int8", max_model_len=96, kv_cache_memory=1 << 20,
              max_num_batched_tokens=24)
    _check(llm, prompts, expected, "int8 KV, PyTorch attention")


def test_bf16_model_runs_and_differs_little_from_its_float_cache(tiny_models, prompts):
    path, _ = tiny_models("llama")
    kwargs = dict(dtype="bfloat16", max_model_len=96, kv_cache_memory=1 << 20)
    plain = LLM(path, **kwargs).generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    int8 = LLM(path, kv_cache_dtype="int8", **kwargs)
    quant = int8.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    first_tokens = [a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(plain, quant)]
    assert sum(first_tokens) >= len(prompts) - 2
    again = int8.generate([{"prompt_token_ids": p} for p in prompts[::-1]], GREEDY, use_tqdm=False)[::-1]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in quant]


def test_plan_holds_at_least_1_9x_the_bf16_tokens(tiny_models):
    from kvflow.loader import load_model_config

    path, _ = tiny_models("llama")
    cfg = load_model_config(path)
    bf16 = plan_kv_cache(cfg, torch.bfloat16, 16, 96, kv_cache_memory=1 << 20)
    int8 = plan_kv_cache(cfg, torch.bfloat16, 16, 96, kv_cache_memory=1 << 20, kv_cache_dtype="int8")
    assert int8.bytes_per_token == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.head_dim + 2)
    assert int8.num_tokens >= 1.75 * bf16.num_tokens  # head_dim 16: 32 / 18 bytes
    text = int8.describe()
    assert "KV cache dtype      int8" in text and "<- this plan" in text and "bfloat16" in text


def test_plan_for_the_default_model_shape():
    """SmolLM2's head_dim of 64: 1.94x the bf16 tokens in the same memory."""
    from kvflow.config import ModelConfig

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      max_position_embeddings=8192)
    bf16 = plan_kv_cache(cfg, torch.bfloat16, 16, 8192)
    int8 = plan_kv_cache(cfg, torch.bfloat16, 16, 8192, kv_cache_dtype="int8")
    assert int8.num_tokens / bf16.num_tokens >= 1.9


def test_unsupported_kv_cache_dtype_is_refused_at_start(tiny_models):
    path, _ = tiny_models("llama")
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'fp8' is not supported .*auto, int8"):
        LLM(path, kv_cache_dtype="fp8")
