"""The default model (9 query heads over 3 KV heads, 30 layers) with T=3, fp32, against
transformers token for token (tie rule), logprobs included: its logits come back to the
driver and are sampled there. (P=2 and 4 prompts x 48 tokens for both layouts passed too, but
take ~3 minutes on this machine: docs/benchmarks.md has the command.)"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from tests.conftest import assert_greedy_match

TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, min_tokens=TOKENS, logprobs=5)


@pytest.fixture(autouse=True)
def _forked(monkeypatch):
    monkeypatch.setenv("KVFLOW_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.setenv("KVFLOW_OVERSUBSCRIBE", "1")


def test_default_model_tensor_parallel_3(smollm2_gguf, reference):
    layout = dict(tensor_parallel_size=3)
    rows = reference["prompts"][:2]
    llm = LLM(dtype="float32", kv_cache_memory=32 << 20, max_model_len=512, num_threads=1, **layout)
    try:
        outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows], GREEDY, use_tqdm=False)
        for row, out in zip(rows, outs):
            assert_greedy_match(out.outputs[0].token_ids, row["greedy_48_ignore_eos"][:TOKENS],
                                row["greedy_48_top2_gap"], f"{layout} {row['prompt'][-30:]!r}")
            assert len(out.outputs[0].logprobs) == TOKENS
    finally:
        llm.shutdown()
