"""The default model's Q4_1 weights run as shipped: the same greedy tokens as transformers on
the dequantized file (its weights are bit for bit gguf's dequantization; only the kernel's
summation order differs, so the tie rule of conftest applies), batched or chunked."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.loader import resolve_quantization
from tests.conftest import assert_greedy_match

GREEDY_48 = SamplingParams(temperature=0, max_tokens=48, min_tokens=48)


@pytest.fixture(scope="module")
def shipped(smollm2_gguf):
    return LLM(dtype="float32", quantization="gguf", kv_cache_memory=128 << 20, max_model_len=2048,
               max_num_batched_tokens=256)


def test_runs_on_the_files_own_blocks(shipped):
    model = shipped.engine.runner.model
    sources = {m.quant_weight.source for m in model.modules() if getattr(m, "quant_weight", None) is not None}
    assert sources == {"gguf:Q4_1", "gguf:Q8_0"}
    assert model.lm_head.quant_weight.source == "gguf:Q8_0"  # the tied embedding's own blocks
    assert model.embed_tokens.weight.dtype == torch.float32  # the lookup reads the table


def test_reference_prompts_match_transformers(shipped, reference):
    rows = reference["prompts"]
    outs = shipped.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows], GREEDY_48, use_tqdm=False)
    for row, out in zip(rows, outs):
        assert_greedy_match(out.outputs[0].token_ids, row["greedy_48_ignore_eos"], row["greedy_48_top2_gap"],
                            row["prompt"][-40:])
    # alone, with its 547-token prompt chunked by the 256-token budget
    row = max(rows, key=lambda r: len(r["prompt_token_ids"]))
    out = shipped.generate([{"prompt_token_ids": row["prompt_token_ids"]}], GREEDY_48, use_tqdm=False)[0]
    assert_greedy_match(out.outputs[0].token_ids, row["greedy_48_ignore_eos"], row["greedy_48_top2_gap"], "alone")
    kv = shipped.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_default_is_the_files_quantization_unless_a_dtype_is_given(smollm2_gguf):
    assert resolve_quantization(smollm2_gguf, None).method == "gguf"
    assert resolve_quantization(smollm2_gguf, None, dtype="float32") is None
    assert resolve_quantization(smollm2_gguf, "none") is None
    assert resolve_quantization(smollm2_gguf, "gguf", dtype="float32").method == "gguf"
    assert resolve_quantization(smollm2_gguf, "int8").method == "int8"
