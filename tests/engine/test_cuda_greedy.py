"""On a GPU: the engine with device="cuda" against the CPU float32 path, under the tie rule.

Greedy float32 output equals the CPU reference token for token whatever the batching (each
prompt alone or all together), the chunking (a 19-token budget) and whether decode steps replay
CUDA graphs or run eagerly; bf16 runs end to end with every KV block returned. scripts/gpu_check
runs this file; without a GPU it is skipped.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.conftest import check_greedy_run, save_tiny_llama, shared_prefix_prompts
from tests.engine.cuda_reference import greedy_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check runs it)")

MAX_TOKENS = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# A small pool: several engines share the GPU within one process (the default would take 90 %).
GPU = dict(device="cuda", kv_cache_memory=128 << 20, max_num_seqs=32)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-gpu"), num_attention_heads=8, num_key_value_heads=2,
                           hidden_size=128)[0]
    prompts = shared_prefix_prompts(seed=5, num_own=12)
    return path, prompts, greedy_reference(path, prompts, MAX_TOKENS)


@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_batched_and_alone_equal_the_cpu_reference(case, eager):
    path, prompts, refs = case
    llm = LLM(path, dtype="float32", enforce_eager=eager, **GPU)
    assert (llm.engine.runner.decode_graphs is None) == eager
    check_greedy_run(llm, prompts, refs, PARAMS, "batched")
    for i in (0, 5, len(prompts) - 1):
        check_greedy_run(llm, prompts, refs, PARAMS, "alone", [i])


def test_chunked_prefill_equals_the_cpu_reference(case):
    path, prompts, refs = case
    check_greedy_run(LLM(path, dtype="float32", max_num_batched_tokens=19, **GPU), prompts, refs, PARAMS, "chunked")


def test_bf16_runs_and_returns_every_block(case):
    path, prompts, _ = case
    llm = LLM(path, **GPU)  # dtype auto: bf16 on the GPU
    assert llm.engine.dtype == torch.bfloat16 and llm.engine.device.type == "cuda"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.kv_cache_manager.num_blocks
