"""The KV plan is arithmetic on the shapes; the engine's start-up log must agree with it."""

from __future__ import annotations

import logging

import pytest
import torch

from kvflow.config import ModelConfig
from kvflow.engine.memory_plan import plan_kv_cache, system_memory_bytes

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize("cfg, dtype, per_token", [
    (LLAMA3_8B, torch.bfloat16, 32 * 2 * 8 * 128 * 2),
    (LLAMA3_8B, torch.float32, 32 * 2 * 8 * 128 * 4),
    (SMOLLM2, torch.float32, 30 * 2 * 3 * 64 * 4),
    (SMOLLM2, torch.bfloat16, 30 * 2 * 3 * 64 * 2),
])
def test_plan_matches_formula(cfg, dtype, per_token):
    mc = ModelConfig.from_hf_config(cfg)
    plan = plan_kv_cache(mc, dtype, block_size=16, max_model_len=8192, kv_cache_memory=4 << 30)
    assert plan.bytes_per_token == per_token
    assert plan.num_blocks == (4 << 30) // (per_token * 16)
    assert plan.max_concurrency == pytest.approx(plan.num_blocks / (8192 / 16))
    assert f"{plan.num_blocks:,} blocks" in plan.describe()


def test_parameter_count_of_known_shapes():
    assert ModelConfig.from_hf_config(SMOLLM2).num_parameters() == 134_515_008
    assert ModelConfig.from_hf_config(LLAMA3_8B).num_parameters() == 8_030_261_248


def test_memory_utilization_subtracts_weights():
    mc = ModelConfig.from_hf_config(SMOLLM2)
    plan = plan_kv_cache(mc, torch.bfloat16, 16, 8192, memory_utilization=0.5)
    budget = int(0.5 * system_memory_bytes()) - mc.num_parameters() * 2
    assert plan.num_blocks == budget // (plan.bytes_per_token * 16)


def test_default_budget_holds_one_full_length_sequence():
    """512 MiB unless one max_model_len sequence needs more: a default that cannot start a big
    model would be no default."""
    small = plan_kv_cache(ModelConfig.from_hf_config(SMOLLM2), torch.bfloat16, 16, 8192)
    assert small.kv_cache_bytes == (512 << 20) // small.bytes_per_block * small.bytes_per_block
    big = plan_kv_cache(ModelConfig.from_hf_config(LLAMA3_8B), torch.bfloat16, 16, 8192)
    assert big.num_tokens == 8192  # 128 KiB per token: exactly one full sequence (1 GiB)


def test_too_small_names_the_knob():
    mc = ModelConfig.from_hf_config(LLAMA3_8B)
    with pytest.raises(ValueError, match=r"raise kv_cache_memory to at least 1,073,741,824 bytes .* or lower max_model_len"):
        plan_kv_cache(mc, torch.bfloat16, 16, 8192, kv_cache_memory=1 << 29)
    with pytest.raises(ValueError, match="set one, not both"):
        plan_kv_cache(mc, torch.bfloat16, 16, 8192, kv_cache_memory=1 << 30, memory_utilization=0.5)


def test_engine_start_up_log_agrees(caplog, tmp_path):
    import json

    from kvflow import LLM

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2 | {"num_hidden_layers": 2}))
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", kv_cache_memory=64 << 20, max_model_len=1024)
    plan = llm.engine.plan
    assert plan.bytes_per_token == 2 * 2 * 3 * 64 * 2
    assert plan.num_blocks == (64 << 20) // (plan.bytes_per_token * 16) == llm.engine.kv_cache_manager.num_blocks
    assert plan.describe() in caplog.text
    assert llm.engine.runner.kv_caches[0].shape == (2, plan.num_blocks, 16, 3, 64)


@pytest.mark.parametrize("method, group, bytes_per_weight", [("int8", None, 1.0), ("int4", 32, 0.75), ("int4", 128, 0.5625)])
def test_quantized_weights_are_planned_smaller(method, group, bytes_per_weight):
    from kvflow.quantization.config import QuantizationConfig

    cfg = ModelConfig.from_hf_config(SMOLLM2)
    plain = plan_kv_cache(cfg, torch.bfloat16, 16, 8192, memory_utilization=0.1)
    quant = QuantizationConfig.parse(method, group)
    plan = plan_kv_cache(cfg, torch.bfloat16, 16, 8192, memory_utilization=0.1, quantization=quant)
    linear = cfg.num_linear_parameters()
    assert linear == 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    assert plan.weight_bytes == plain.weight_bytes - 2 * linear + int(linear * bytes_per_weight)
    assert plan.num_blocks > plain.num_blocks  # the bytes saved go to the KV cache
    assert f"quantization        {quant.describe()}" in plan.describe()
