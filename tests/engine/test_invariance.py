"""Greedy output must not depend on batching, chunking, block size or scheduling limits.

Every configuration is compared with the same transformers reference under the tie rule,
and the block pool must be whole again afterwards.
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from tests.conftest import assert_greedy_match
from tests.engine.prompts import INVARIANCE_TOKENS, invariance_prompts

PARAMS = SamplingParams(temperature=0, max_tokens=INVARIANCE_TOKENS, min_tokens=INVARIANCE_TOKENS)


@pytest.fixture(scope="module")
def workload(extra_reference):
    """32 mixed-length prompts plus two of over 1,000 tokens, with their transformers outputs."""
    prompts = invariance_prompts()
    rows = extra_reference["invariance"]
    assert [r["prompt_token_ids"] for r in rows] == prompts, "stale reference: run tests/data/make_reference.py"
    return prompts, [(r["tokens"], r["gaps"]) for r in rows]


def _check(llm: LLM, prompts, refs, label: str, indices=None):
    indices = range(len(prompts)) if indices is None else indices
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in indices], PARAMS, use_tqdm=False)
    for i, out in zip(indices, outs):
        ref, gaps = refs[i]
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"{label} prompt {i} (len {len(prompts[i])})")
    engine = llm.engine
    engine.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    return outs


def test_alone_and_batched(smollm2_fp32, workload):
    prompts, refs = workload
    for i in (0, 5, 17, 32, 33):
        _check(smollm2_fp32, prompts, refs, "alone", [i])
    _check(smollm2_fp32, prompts, refs, "batch of 34")


@pytest.mark.parametrize(
    "config",
    [
        dict(max_num_seqs=3),
        dict(max_num_batched_tokens=64),
        dict(block_size=1),
        dict(block_size=32, enable_prefix_caching=False),
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_scheduling_limits(workload, config):
    prompts, refs = workload
    llm = LLM(dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048, **config)
    outs = _check(llm, prompts, refs, str(config))
    if config.get("max_num_batched_tokens") == 64:
        # The long prompts really were split: 1,030 tokens cannot fit one 64-token step.
        assert all(len(o.prompt_token_ids) <= 64 or o.metrics.first_token_time > o.metrics.first_scheduled_time
                   for o in outs)
