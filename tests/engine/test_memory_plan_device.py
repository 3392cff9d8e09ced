"""The KV plan on a GPU: gpu_memory_utilization of its memory, and a budget over free memory refused."""

from __future__ import annotations

import pytest
import torch

from kvflow.config import ModelConfig
from kvflow.engine.memory_plan import cuda_activation_bytes, plan_kv_cache

GIB = 1 << 30
LLAMA3_8B = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)


def test_gpu_utilization_takes_its_share_less_weights_activations_and_memory_in_use():
    free, total = 130 * GIB, 140 * GIB  # 10 GiB already used elsewhere
    act = cuda_activation_bytes(LLAMA3_8B, torch.bfloat16, 2048, 256)
    plan = plan_kv_cache(LLAMA3_8B, torch.bfloat16, 16, 8192, device_memory=(free, total), activation_bytes=act)
    budget = int(0.9 * total) - (total - free) - plan.weight_bytes - act
    assert plan.bytes_per_token == 131072  # 32 layers x K,V x 8 heads x 128 x 2 bytes
    assert plan.num_blocks == budget // (plan.bytes_per_token * 16)
    assert list(plan.bytes_per_token_by_kv_dtype) == ["bfloat16"]  # the int8 cache is the CPU's
    half = plan_kv_cache(LLAMA3_8B, torch.bfloat16, 16, 8192, device_memory=(free, total), activation_bytes=act,
                         gpu_memory_utilization=0.5)
    assert half.num_blocks < plan.num_blocks


def test_a_kv_budget_over_free_memory_is_refused():
    with pytest.raises(ValueError, match=r"kv_cache_memory=.*exceeds the GPU's free memory"):
        plan_kv_cache(LLAMA3_8B, torch.bfloat16, 16, 8192, kv_cache_memory=60 * GIB, device_memory=(70 * GIB, 80 * GIB))
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.1 leaves no memory"):
        plan_kv_cache(LLAMA3_8B, torch.bfloat16, 16, 8192, device_memory=(20 * GIB, 20 * GIB), gpu_memory_utilization=0.1)


def test_gpu_settings_on_the_cpu_are_refused():
    with pytest.raises(ValueError, match="gpu_memory_utilization applies to --device cuda"):
        plan_kv_cache(LLAMA3_8B, torch.bfloat16, 16, 8192, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="memory_utilization is a share of host memory"):
        plan_kv_cache(LLAMA3_8B, torch.bfloat16, 16, 8192, memory_utilization=0.5, device_memory=(GIB, GIB))


def test_plan_device_memory_cli(capsys):
    from kvflow.entrypoints.cli import main

    assert main(["plan", "--device-memory", "141GiB", "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "device: GPU with 141.00 GiB free" in out and "KV cache dtype" in out
