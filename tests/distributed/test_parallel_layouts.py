"""Greedy fp32 tokens with T=2, P=2 and T=2 x P=2 equal T=1's (tie rule), under batching,
chunked prefill, prefix caching and preemption, in worker processes talking over gloo.

The reference is transformers on the same random weights; every layout is checked against it
with the same tie rule as the single-process engine, and every KV block must be back after.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers import cpu_kernels
from kvflow.distributed.shm_all_reduce import shm_all_reduce_supported
from tests.conftest import assert_greedy_match, check_greedy_run
from tests.distributed.conftest import NEW_TOKENS, engine_kwargs

# min_tokens bans EOS, so the driver samples the logits that come back; ignore_eos keeps the
# bare greedy pick, which the output rank takes itself (only token ids come back).
LOGITS_PATH = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
ARGMAX_PATH = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _run_layout(model, tp: int, pp: int) -> LLM:
    path, prompts, refs = model
    llm = LLM(path, **engine_kwargs(path, tp, pp))
    label = f"T={tp} P={pp}"
    check_greedy_run(llm, prompts, refs, LOGITS_PATH, f"{label} logits path")
    assert llm.engine.scheduler.num_preemptions > 0, "the workload was meant to preempt"
    assert llm.engine.kv_cache_manager.prefix_stats.hits > 0, "the shared prefix was meant to hit the cache"
    check_greedy_run(llm, prompts, refs, ARGMAX_PATH, f"{label} argmax path")
    check_greedy_run(llm, prompts, refs, ARGMAX_PATH, f"{label} alone", [len(prompts) - 1])
    if pp > 1:  # the stages overlapped: P batches were in flight at once (engine/batch_queue.py)
        assert llm.engine.batch_queue.peak_in_flight == pp
    fused = [info["fused_stack"] for info in llm.engine.distributed.executor.worker_info]
    kernels = cpu_kernels.load()
    # T = 1: each stage's layers in one C++ call where the CPU has the float32 GEMM; T > 1: the modules
    assert fused == [tp == 1 and kernels is not None and kernels.has_gemm(torch.float32)] * (tp * pp)
    # T > 1 on one host: the row-parallel sums go through shared memory (distributed/shm_all_reduce.py)
    sums = [info["all_reduce"] for info in llm.engine.distributed.executor.worker_info]
    assert sums == [None if tp == 1 else "shm" if shm_all_reduce_supported() else "gloo"] * (tp * pp)
    return llm


def test_single_process_reference(tiny_gqa):
    """The same workload and limits on one process (uni): the baseline the layouts must match."""
    path, prompts, refs = tiny_gqa
    llm = LLM(path, **engine_kwargs(path))
    check_greedy_run(llm, prompts, refs, LOGITS_PATH, "T=1")
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.fixture
def forked_workers(monkeypatch):
    """Forked workers start in under a second instead of ~10-30 s (torch imported once): the
    same worker code, which keeps these tests inside the suite's time budget. The spawned
    start (the default) is exercised by test_worker_failure.py's start-up test."""
    monkeypatch.setenv("KVFLOW_WORKER_MULTIPROC_METHOD", "fork")


def test_tensor_parallel_2(tiny_gqa, forked_workers):
    llm = _run_layout(tiny_gqa, 2, 1)
    assert len(llm.engine.distributed.executor.worker_pids) == 2
    llm.shutdown()


def test_tensor_parallel_3_nine_heads(tiny_nine_heads, forked_workers):
    """The default model's split (9 heads, 3 KV heads: 3 and 1 per rank) on a tiny model."""
    _run_layout(tiny_nine_heads, 3, 1).shutdown()


def test_pipeline_parallel_2(tiny_gqa, forked_workers):
    _run_layout(tiny_gqa, 1, 2).shutdown()


def test_pipeline_aborts_a_sequence_in_flight(tiny_gqa, forked_workers):
    """P=2 keeps two batches in flight; a sequence aborted while its batch is in flight loses its
    blocks at once and its late reply is dropped; every other request keeps T=1's tokens."""
    path, prompts, refs = tiny_gqa
    llm = LLM(path, **engine_kwargs(path, 1, 2))
    engine = llm.engine
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, ARGMAX_PATH)
        outputs, victim = {}, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
            queue = engine.batch_queue
            if victim is None and queue.num_in_flight == 1 and queue.peak_in_flight == 2:
                in_flight = queue.in_flight_sequences()
                # one already sampled a token (a decode in flight), so the abort drops a real reply
                decoding = [s for s in in_flight if s.output_token_ids]
                if decoding:
                    victim = decoding[0].request_id
                    assert engine.abort_request(victim)
                    assert victim not in [s.request_id for s in engine.scheduler.running]
        assert victim is not None, "no decode was ever in flight behind another batch"
        assert queue.num_batches > 2 and queue.peak_in_flight == 2
        for i in range(len(prompts)):
            if str(i) != victim:
                assert_greedy_match(outputs[str(i)].outputs[0].token_ids, *refs[i], f"P=2 prompt {i}")
        assert victim not in outputs or len(outputs[victim].outputs[0].token_ids) < NEW_TOKENS
        engine.check_integrity()
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    finally:
        llm.shutdown()


def test_tensor_2_by_pipeline_2_replicated_kv_head(tiny_mqa, forked_workers):
    """4 ranks; T=2 exceeds the model's single KV head, so each stage's two ranks hold a copy."""
    _run_layout(tiny_mqa, 2, 2).shutdown()


def test_speculation_and_seeded_sampling_through_the_driver(tiny_gqa, forked_workers):
    """n-gram drafts (verified rows come back as logits) and seeded random sampling with
    penalties and logprobs: the driver samples what T=2 returns exactly as T=1 samples its own."""
    path = tiny_gqa[0]
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 10}, {"prompt_token_ids": [9, 10, 11] * 12}]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=16, logprobs=2, repetition_penalty=1.1)
    kwargs = dict(dtype="float32", kv_cache_memory=4 << 20, max_model_len=512, num_threads=1, speculative_config=spec)
    one, two = LLM(path, **kwargs), LLM(path, tensor_parallel_size=2, **kwargs)
    try:
        for params in (greedy, seeded):
            a, b = one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b], params
        assert two.engine.get_stats().spec_decode.num_accepted_tokens > 0
    finally:
        two.shutdown()
