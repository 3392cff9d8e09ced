"""Bitwise invariance: a request's greedy tokens and the logprobs of every step do not depend on
how the scheduler cut the work (docs/architecture.md, "Attention numerics").

In bf16 and float32, on a tiny random Llama (GQA, so attention rows come in groups), 112
prompts of every length from 1 to 64 (every remainder modulo the block sizes) and longer ones,
a third of them sharing a 40-token prefix, are run under one configuration taken as the
reference (no prefix cache, default budget, block size 16) and compared bit for bit with:
  - the prefix cache on, cold and then warm (whole blocks served from the cache, the rest of the
    prompt computed, often a single token, which then runs through the decode kernel);
  - token budgets of 1, 7 and 32 per step (prompts cut into chunks, one-token chunks included);
  - each request alone instead of batched with up to 111 others;
  - block sizes 1 and 32;
  - a pool so small that sequences are preempted and recomputed.
The default model is checked the same way on the prompt that exposed the bf16 seam (a chat
prompt answered differently on a warm prefix cache).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.conftest import save_tiny_llama

DTYPES = pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
PARAMS = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=2)


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory) -> str:
    """A random Llama with 6 query heads over 2 KV heads of 32 dims, sharpened so greedy is decisive."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-gqa"), seed=4321, vocab_size=512, hidden_size=192,
                           intermediate_size=384, num_attention_heads=6)[0]


def invariance_prompts() -> list[list[int]]:
    rng = np.random.default_rng(19)
    shared = rng.integers(3, 500, 40).tolist()
    lengths = list(range(1, 65)) + rng.integers(65, 300, 48).tolist()
    prompts = [rng.integers(3, 500, n).tolist() for n in lengths]
    for i in range(0, len(prompts), 3):  # a third share a 40-token prefix (2.5 blocks of 16)
        prompts[i] = shared + prompts[i]
    return prompts


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[tuple]:
    """Each request's first PARAMS.max_tokens tokens and the logprobs of each of those steps."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_integrity()
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks, "blocks were not all returned to the pool"
    n = PARAMS.max_tokens
    return [(tuple(o.outputs[0].token_ids[:n]), tuple(tuple(sorted(lp.items())) for lp in o.outputs[0].logprobs[:n]))
            for o in outs]


def _assert_same(got: list[tuple], ref: list[tuple], prompts, label: str) -> None:
    bad = [i for i, (g, r) in enumerate(zip(got, ref)) if g != r]
    assert not bad, (f"{label}: {len(bad)} of {len(ref)} requests differ from the reference, e.g. prompt {bad[0]} "
                     f"(length {len(prompts[bad[0]])}): {got[bad[0]]} vs {ref[bad[0]]}")


@pytest.fixture(scope="module")
def reference(gqa_model):
    prompts = invariance_prompts()
    cache: dict[str, list[tuple]] = {}

    def get(dtype: str) -> list[tuple]:
        if dtype not in cache:
            cache[dtype] = _run(LLM(gqa_model, dtype=dtype, enable_prefix_caching=False), prompts)
        return cache[dtype]

    return prompts, get


@DTYPES
def test_prefix_cache_cold_and_warm(gqa_model, reference, dtype):
    prompts, ref = reference
    llm = LLM(gqa_model, dtype=dtype, enable_prefix_caching=True)
    _assert_same(_run(llm, prompts), ref(dtype), prompts, "prefix cache, cold")
    hits = llm.engine.get_stats().prefix_cache_hits
    _assert_same(_run(llm, prompts), ref(dtype), prompts, "prefix cache, warm")
    assert llm.engine.get_stats().prefix_cache_hits > hits, "the warm run took nothing from the prefix cache"


@DTYPES
@pytest.mark.parametrize("config", [
    dict(max_num_batched_tokens=1), dict(max_num_batched_tokens=7), dict(max_num_batched_tokens=32),
    dict(max_num_seqs=1), dict(block_size=1), dict(block_size=32),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_scheduling_does_not_change_bits(gqa_model, reference, dtype, config):
    prompts, ref = reference
    # A one-token budget makes one step per token: the first 40 prompts (lengths 1-40) cover it.
    subset = 40 if config.get("max_num_batched_tokens") == 1 else len(prompts)
    llm = LLM(gqa_model, dtype=dtype, enable_prefix_caching=False, **config)
    _assert_same(_run(llm, prompts[:subset]), ref(dtype)[:subset], prompts, str(config))


@DTYPES
def test_preemption_does_not_change_bits(gqa_model, reference, dtype):
    prompts, ref = reference
    # Room for two of the longest requests, admitted with no decode headroom and decoding 40
    # tokens (2-3 new blocks each), so that running sequences must give their blocks up and
    # be recomputed later; their first tokens are compared.
    max_model_len = 384
    bytes_per_token = 2 * 2 * 2 * 32 * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    llm = LLM(gqa_model, dtype=dtype, enable_prefix_caching=False, max_model_len=max_model_len,
              kv_cache_memory=2 * max_model_len * bytes_per_token, max_num_batched_tokens=64)
    llm.engine.scheduler.config.admission_headroom_blocks = 0
    longer = SamplingParams(temperature=0, max_tokens=40, min_tokens=40, logprobs=2)
    _assert_same(_run(llm, prompts, longer), ref(dtype), prompts, "small pool")
    assert llm.engine.get_stats().num_preemptions > 0, "the pool was large enough that nothing was preempted"


GREAT_WALL = [{"role": "user", "content": "用一句话介绍一下长城。"}]


@DTYPES
def test_default_model_warm_cache_and_one_token_chunks(smollm2_gguf, dtype):
    """The 49-token chat prompt whose 49th token runs alone on a warm cache (48 tokens = 3 blocks
    come from the prefix cache), and under a budget that leaves one-token chunks."""
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    llm = LLM(smollm2_gguf, dtype=dtype, max_model_len=512, kv_cache_memory=64 << 20)
    prompt = llm.apply_chat_template(GREAT_WALL)
    assert len(prompt["prompt_token_ids"]) == 49

    def answer(engine: LLM) -> tuple:
        out = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        return tuple(out.token_ids), tuple(tuple(sorted(lp.items())) for lp in out.logprobs)

    cold = answer(llm)
    assert answer(llm) == cold, "the warm prefix cache changed the answer"
    assert llm.engine.get_stats().prefix_cache_hits >= 3
    chunked = LLM(smollm2_gguf, dtype=dtype, max_model_len=512, kv_cache_memory=64 << 20, max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    assert answer(chunked) == cold, "chunks of 16 (the last one a single token) changed the answer"
