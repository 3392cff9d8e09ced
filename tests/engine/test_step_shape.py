"""Step shapes (engine/step_shape.py): what each step computed, as bench roofline counts it."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.step_shape import StepShape

PROMPTS = [list(range(3, 3 + 13)), list(range(40, 40 + 7)), list(range(70, 70 + 21))]
OUTPUTS = [4, 6, 3]


def _run(path: str, budget: int) -> list[StepShape]:
    llm = LLM(path, dtype="float32", max_model_len=64, kv_cache_memory=1 << 20, max_num_batched_tokens=budget,
              enable_prefix_caching=False)
    engine = llm.engine
    engine.step_shapes = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, OUTPUTS)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.step_shapes


@pytest.mark.parametrize("budget", [64, 8])
def test_totals_follow_from_the_requests_whatever_the_chunking(tiny_models, budget):
    path, _ = tiny_models("llama")
    shapes = _run(path, budget)
    computed = [len(p) + n - 1 for p, n in zip(PROMPTS, OUTPUTS)]  # the last output token is never fed back
    assert sum(s.tokens for s in shapes) == sum(computed)
    assert sum(s.logits_rows for s in shapes) == sum(OUTPUTS)  # one sampled row per output token
    # Causal attention: position i (from 1) scores i keys, however the prompt was chunked.
    assert sum(s.attention_pairs for s in shapes) == sum(c * (c + 1) // 2 for c in computed)
    assert all(s.tokens <= budget for s in shapes)
    assert all(s.kv_tokens_read >= s.tokens for s in shapes)
    # The last step only decodes: a row per sequence, each scoring (and reading) its whole context once.
    last = shapes[-1]
    assert last.tokens == last.logits_rows >= 1
    assert last.attention_pairs == last.kv_tokens_read and last.kv_tokens_read <= sum(computed)


def test_chunked_prefill_reads_the_context_again_each_chunk(tiny_models):
    whole, chunked = _run(tiny_models("llama")[0], 64), _run(tiny_models("llama")[0], 8)
    assert len(chunked) > len(whole)
    assert sum(s.kv_tokens_read for s in chunked) > sum(s.kv_tokens_read for s in whole)


def test_nothing_is_recorded_unless_asked(tiny_models):
    llm = LLM(tiny_models("llama")[0], dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert llm.engine.step_shapes is None


def test_embedding_rows_skip_the_lm_head(tiny_models):
    """An embedding request's completed prompt goes to the pooler: no LM-head row is counted."""
    from kvflow import PoolingParams

    path, _ = tiny_models("llama")
    engine = LLM(path, dtype="float32", max_model_len=64, kv_cache_memory=1 << 20).engine
    engine.step_shapes = []
    engine.add_request("e", {"prompt_token_ids": PROMPTS[0]}, PoolingParams())
    engine.add_request("g", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert sum(s.tokens for s in engine.step_shapes) == len(PROMPTS[0]) + len(PROMPTS[1])
    assert sum(s.logits_rows for s in engine.step_shapes) == 1  # the generating request's one token
