"""Every supported architecture against transformers, on tiny random models (no downloads)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.conftest import assert_greedy_match, hf_greedy

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen2moe", "qwen3moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logprobs_match_transformers(arch, tiny_models):
    path, hf = tiny_models(arch)
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=48)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (7, 33, 100)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, gaps, first_logits = hf_greedy(hf, prompt, 24)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, label=f"{arch} len={len(prompt)}")
        ref_logprobs = torch.log_softmax(first_logits, -1)
        for token_id, logprob in out.outputs[0].logprobs[0].items():
            assert logprob.logprob == pytest.approx(float(ref_logprobs[token_id]), abs=1e-4)
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.kv_cache_manager.num_blocks


def test_unknown_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10,
                                                      "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                                                      "num_attention_heads": 1}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(tmp_path), load_format="dummy")


def test_dummy_weights_run_from_config_alone(tmp_path, tiny_models):
    path, _ = tiny_models("llama")
    (tmp_path / "config.json").write_text((__import__("pathlib").Path(path) / "config.json").read_text())
    llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", kv_cache_memory=1 << 20)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
