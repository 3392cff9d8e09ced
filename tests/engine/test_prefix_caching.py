"""Prefix caching changes how much is computed, never what is generated."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from tests.conftest import assert_greedy_match
from tests.engine.prompts import invariance_prompts

N = 12
PARAMS = SamplingParams(temperature=0, max_tokens=N, min_tokens=N, logprobs=2)


def _gaps(out) -> list[float]:
    """Top-2 gaps from our own log-probabilities (a log-prob difference is a logit difference)."""
    gaps = []
    for step in out.outputs[0].logprobs:
        top = sorted((lp.logprob for lp in step.values()), reverse=True)
        gaps.append(top[0] - top[1])
    return gaps


@pytest.fixture(scope="module")
def prompts():
    base = invariance_prompts()
    a = base[32]  # 1,030 tokens
    return {
        "A": a,
        "B: shares 31 blocks": a[:500] + base[0],
        "C: whole prompt cached": list(a),
        "D: shares nothing": base[5],
        "E: one block past A": a + base[1][:16],
    }


@pytest.fixture(scope="module")
def uncached(prompts):
    llm = LLM(dtype="float32", kv_cache_memory=128 << 20, max_model_len=2048, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], PARAMS, use_tqdm=False)
    assert llm.engine.get_stats().prefix_cache_hits == 0
    return {name: (o.outputs[0].token_ids, _gaps(o)) for name, o in zip(prompts, outs)}


def test_cold_then_warm_matches_uncached(prompts, uncached):
    llm = LLM(dtype="float32", kv_cache_memory=128 << 20, max_model_len=2048)
    engine = llm.engine
    first = llm.generate({"prompt_token_ids": prompts["A"]}, PARAMS, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert_greedy_match(first.outputs[0].token_ids, *uncached["A"], "A cold")

    computed_before = engine.get_stats().computed_tokens
    names = [n for n in prompts if n != "A"]
    warm = llm.generate([{"prompt_token_ids": prompts[n]} for n in names], PARAMS, use_tqdm=False)
    cached = {n: o.num_cached_tokens for n, o in zip(names, warm)}
    assert cached["B: shares 31 blocks"] == 31 * 16
    assert cached["C: whole prompt cached"] == (1030 - 1) // 16 * 16  # the last token is always computed
    assert cached["D: shares nothing"] == 0
    assert cached["E: one block past A"] == 1030 // 16 * 16
    for name, out in zip(names, warm):
        assert_greedy_match(out.outputs[0].token_ids, *uncached[name], f"{name} warm")
    computed = engine.get_stats().computed_tokens - computed_before
    total = sum(len(prompts[n]) for n in names) + (N - 1) * len(names)  # the last token is never fed back
    assert computed == total - sum(cached.values())
    stats = engine.get_stats()
    assert stats.prefix_cache_hits == sum(cached.values())
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts.values())
    engine.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_all_at_once_with_caching_matches_uncached(prompts, uncached):
    """Shared prefixes admitted in the same step: nothing is cached yet, outputs still equal."""
    llm = LLM(dtype="float32", kv_cache_memory=128 << 20, max_model_len=2048, max_num_batched_tokens=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], PARAMS, use_tqdm=False)
    for name, out in zip(prompts, outs):
        assert_greedy_match(out.outputs[0].token_ids, *uncached[name], f"{name} batched")
    llm.engine.check_integrity()


def test_eviction_under_pressure_keeps_outputs(prompts, uncached):
    """A pool too small to keep everything cached: idle blocks are evicted LRU, outputs unchanged."""
    llm = LLM(dtype="float32", kv_cache_memory=1320 * 46080, max_model_len=1100)
    for name in ("A", "D: shares nothing", "B: shares 31 blocks", "C: whole prompt cached"):
        out = llm.generate({"prompt_token_ids": prompts[name]}, PARAMS, use_tqdm=False)[0]
        assert_greedy_match(out.outputs[0].token_ids, *uncached[name], f"{name} evicting")
    llm.engine.check_integrity()
