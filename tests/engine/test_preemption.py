"""A KV cache with room for about two requests: 32 requests still finish, outputs unchanged."""

from __future__ import annotations

import random

import pytest

from kvflow import LLM, SamplingParams
from tests.conftest import assert_greedy_match, hf_greedy

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def workload(tiny_models):
    path, hf = tiny_models("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(8, 60))] for _ in range(32)]
    return path, prompts, [hf_greedy(hf, p, NEW_TOKENS)[:2] for p in prompts]


def _bytes_per_token(llm: LLM) -> int:
    return llm.engine.plan.bytes_per_token


def test_preemption_keeps_outputs(workload):
    path, prompts, refs = workload
    max_model_len = 80  # the longest request is 76 tokens
    probe = LLM(path, dtype="float32", kv_cache_memory=1 << 20, max_model_len=max_model_len)
    budget = 2 * max_model_len * _bytes_per_token(probe)
    llm = LLM(path, dtype="float32", kv_cache_memory=budget, max_model_len=max_model_len, max_num_batched_tokens=64)
    assert llm.engine.plan.num_tokens < 3 * 76  # at most two of the longest requests fit
    # Admit greedily (no decode headroom) so that running sequences really do get preempted.
    llm.engine.scheduler.config.admission_headroom_blocks = 0
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (out, (ref, gaps)) in enumerate(zip(outs, refs)):
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"prompt {i}")
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats.num_preemptions
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_manager.num_free_blocks == stats.num_blocks


def test_headroom_avoids_thrashing(workload):
    """The default admission headroom finishes the same work with fewer preemptions."""
    path, prompts, refs = workload
    counts = {}
    for headroom in (0, 1):
        llm = LLM(path, dtype="float32", kv_cache_memory=160 * 2 * 2 * 2 * 16 * 4, max_model_len=80,
                  max_num_batched_tokens=64)
        llm.engine.scheduler.config.admission_headroom_blocks = headroom
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS), use_tqdm=False)
        for out, (ref, gaps) in zip(outs, refs):
            assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"headroom={headroom}")
        counts[headroom] = llm.engine.get_stats().num_preemptions
    assert counts[1] < counts[0]


def test_request_that_cannot_fit_is_refused_at_start(workload):
    path, _, _ = workload
    with pytest.raises(ValueError, match="kv_cache_memory.*max_model_len"):
        LLM(path, dtype="float32", max_model_len=1024, kv_cache_memory=1000)
