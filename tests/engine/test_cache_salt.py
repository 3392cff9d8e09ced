"""vLLM's cache_salt: only requests with the same salt share cached K/V, and the output never changes."""

from __future__ import annotations

import random

import pytest

from kvflow import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    path, _ = tiny_models("llama")
    return LLM(path, dtype="float32", block_size=4, kv_cache_memory=16 << 20)


def run(llm: LLM, prompt: list[int], salt: str | None):
    request = {"prompt_token_ids": prompt, **({"cache_salt": salt} if salt is not None else {})}
    out = llm.generate([request], GREEDY, use_tqdm=False)[0]
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    return out.num_cached_tokens, out.outputs[0].token_ids


def test_only_the_same_salt_shares_the_cache(llm):
    prompt = [random.Random(3).randrange(3, 320) for _ in range(30)]
    cached, tokens = zip(*[run(llm, prompt, salt) for salt in ("tenant-a", "tenant-b", None, "tenant-a", None, "b")])
    assert cached[:3] == (0, 0, 0)  # a salt's first request finds nothing: not the other salt's, not the unsalted
    assert cached[3] > 0 and cached[4] > 0  # its own repeat hits, and so does the unsalted one
    assert cached[5] == 0
    assert all(t == tokens[0] for t in tokens)


@pytest.mark.parametrize("salt", ["", 7])
def test_a_bad_salt_is_refused(llm, salt):
    with pytest.raises(ValueError, match="cache_salt: must be a non-empty string"):
        llm.generate([{"prompt_token_ids": [5, 6, 7], "cache_salt": salt}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
