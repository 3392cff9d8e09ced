"""Parallel sampling (SamplingParams.n > 1): one prompt computed once, n independent samples.

Tiny random Llama (no tokenizer: prompts are token ids) for the engine mechanics; the default
model where text matters (stop strings).
"""

from __future__ import annotations

import random

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.parallel_sampling import derive_seed, sample_request_id
from tests.conftest import assert_greedy_match, hf_greedy

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[0], dtype="float32", kv_cache_memory=8 << 20, max_model_len=512, block_size=BLOCK)


def _prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(length)]


def _assert_pool_free(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert not engine.has_unfinished_requests() and not engine._requests and not engine.sample_groups.groups


def test_greedy_samples_equal_n1_and_transformers(llm, tiny):
    prompt = _prompt(40)
    want = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, min_tokens=12),
                        use_tqdm=False)[0].outputs[0].token_ids
    ref, gaps, _ = hf_greedy(tiny[1], prompt, 12)
    assert_greedy_match(want, ref, gaps, "n=1")
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=0, max_tokens=12, min_tokens=12),
                       use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == want and c.finish_reason == "length" for c in out[0].outputs)
    assert out[0].finished and out[0].prompt_token_ids == prompt
    _assert_pool_free(llm)


def test_seeded_samples_reproducible_and_different(llm):
    prompts = [{"prompt_token_ids": _prompt(30, 1)}, {"prompt_token_ids": _prompt(50, 2)}]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, min_tokens=16)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(first, again):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        samples = [tuple(c.token_ids) for c in a.outputs]
        assert len(set(samples)) == 4, "every sample must be its own draw"
    # Sample 0 keeps the request's seed: it is what n=1 draws with that seed.
    single = llm.generate(prompts[0], SamplingParams(temperature=1.0, seed=7, max_tokens=16, min_tokens=16),
                          use_tqdm=False)[0]
    assert first[0].outputs[0].token_ids == single.outputs[0].token_ids
    # Alone or beside other requests, a seeded sample draws the same tokens.
    alone = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in first[1].outputs]
    _assert_pool_free(llm)


def test_derived_seeds_are_distinct():
    seeds = {derive_seed(s, i) for s in range(50) for i in range(8)}
    assert len(seeds) == 50 * 8  # seed s's sample i is never seed s+i's sample 0
    assert derive_seed(123, 0) == 123 and derive_seed(-5, 3) >= 0


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("prompt_len", [100, 96])
def test_prompt_computed_once_and_blocks_shared(tiny, prefix_caching, prompt_len):
    llm = LLM(tiny[0], dtype="float32", kv_cache_memory=8 << 20, max_model_len=512, block_size=BLOCK,
              enable_prefix_caching=prefix_caching)
    engine, n = llm.engine, 8
    prompt = _prompt(prompt_len, 3)
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=6,
                                                                         min_tokens=6))
    shared = (prompt_len - 1) // BLOCK  # full prompt blocks; the last prompt token is always computed
    kv, tables_seen = engine.kv_cache_manager, False
    while engine.has_unfinished_requests():
        engine.step()
        tables = [kv.block_table(sample_request_id("r", i)) for i in range(n)]
        if all(tables):  # every sample admitted: they hold the very same prompt blocks, not copies
            tables_seen = True
            assert all(t[:shared] == tables[0][:shared] for t in tables)
            assert len({t[shared] for t in tables}) == n  # then each its own block
    assert tables_seen
    stats = engine.get_stats()
    assert stats.prefill_tokens == prompt_len + (n - 1) * (prompt_len - shared * BLOCK)
    assert stats.prefill_tokens < prompt_len + n * BLOCK
    assert stats.prompt_tokens == prompt_len  # the prompt counts once
    assert stats.generation_tokens == n * 6
    _assert_pool_free(llm)


def test_preemption_with_parallel_samples(tiny):
    """A pool for about two sequences: n=4 greedy and seeded runs finish, outputs unchanged."""
    path, hf = tiny
    prompts = [_prompt(30 + 7 * i, 10 + i) for i in range(3)]
    roomy = LLM(path, dtype="float32", kv_cache_memory=8 << 20, max_model_len=80)
    per_token = roomy.engine.plan.bytes_per_token
    small = LLM(path, dtype="float32", kv_cache_memory=2 * 80 * per_token, max_model_len=80, max_num_batched_tokens=64)
    small.engine.scheduler.config.admission_headroom_blocks = 0
    inputs = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(n=4, temperature=0, max_tokens=16, min_tokens=16)
    for prompt, out in zip(prompts, small.generate(inputs, greedy, use_tqdm=False)):
        ref, gaps, _ = hf_greedy(hf, prompt, 16)
        for c in out.outputs:
            assert_greedy_match(c.token_ids, ref, gaps, f"sample {c.index}")
    assert small.engine.get_stats().num_preemptions > 0
    _assert_pool_free(small)
    seeded = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16, min_tokens=16)
    before = small.engine.get_stats().num_preemptions
    got = small.generate(inputs, seeded, use_tqdm=False)
    assert small.engine.get_stats().num_preemptions > before
    want = roomy.generate(inputs, seeded, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    _assert_pool_free(small)


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_abort_frees_every_sample(llm, steps):
    engine = llm.engine
    params = SamplingParams(max_tokens=50, seed=0, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": _prompt(70, 4)}, SamplingParams(n=5, max_tokens=50, seed=0,
                                                                                 ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": _prompt(20, 5)}, params)
    for _ in range(steps):  # 0: samples still held; 1: just released; 3: all decoding
        engine.step()
    assert engine.has_request("a")
    assert engine.abort_request("a")
    assert not engine.has_request("a") and not engine.abort_request("a")
    assert all(s.request_id == "b" for s in engine.scheduler.running + engine.scheduler.waiting)
    while engine.has_unfinished_requests():
        engine.step()
    _assert_pool_free(llm)


def test_abort_by_a_sample_id_aborts_the_request(llm):
    engine = llm.engine
    engine.add_request("c", {"prompt_token_ids": _prompt(40, 6)}, SamplingParams(n=3, max_tokens=50, seed=0,
                                                                                 ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.running_request_ids() == ["c"]
    assert engine.abort_request(engine.scheduler.running[0].request_id)
    assert not engine.has_request("c")
    _assert_pool_free(llm)


def test_prompt_logprobs_once_for_all_samples(llm):
    prompt = {"prompt_token_ids": _prompt(35, 7)}
    one = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    many = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=2, prompt_logprobs=2),
                        use_tqdm=False)[0]
    assert many.prompt_logprobs == one.prompt_logprobs
    assert all(c.token_ids == one.outputs[0].token_ids for c in many.outputs)
    _assert_pool_free(llm)


def test_n_bounds(tiny):
    llm = LLM(tiny[0], dtype="float32", kv_cache_memory=4 << 20, max_model_len=256, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"^n must be at most max_num_seqs \(4\)"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=5), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^n must be an int in \[1, 128\]"):
        SamplingParams(n=10**6)
    _assert_pool_free(llm)
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=4, max_tokens=2),
                            use_tqdm=False)[0].outputs) == 4


def test_n_with_speculative_decoding(tiny):
    """n-gram speculation runs per sample: greedy samples stay identical to decoding without it."""
    path, _ = tiny
    prompt = {"prompt_token_ids": _prompt(12, 8) * 4}  # repetitive, so the n-gram proposer has guesses
    params = SamplingParams(n=3, temperature=0, max_tokens=20, min_tokens=20)
    plain = LLM(path, dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    spec = LLM(path, dtype="float32", kv_cache_memory=8 << 20, max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None})
    want = plain.generate(prompt, params, use_tqdm=False)[0]
    got = spec.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert spec.engine.get_stats().spec_decode.num_draft_tokens > 0
    _assert_pool_free(spec)


def test_stop_strings_per_sample(smollm2_fp32):
    llm = smollm2_fp32
    params = SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=40, stop=["."])
    out = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) > 1
    for c in out.outputs:
        assert "." not in c.text
        assert c.finish_reason == "length" or (c.finish_reason == "stop" and c.stop_reason == ".")
    assert any(c.finish_reason == "stop" for c in out.outputs)
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.kv_cache_manager.num_blocks


def test_waiting_requests_count_a_request_once(tiny):
    """The server's admission bound (--max-waiting) counts requests: n samples released into the
    waiting queue at once must not read as n waiting requests."""
    llm = LLM(tiny[0], dtype="float32", kv_cache_memory=8 << 20, max_model_len=512, block_size=BLOCK,
              max_num_seqs=4)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": _prompt(30, 6)}, SamplingParams(n=4, max_tokens=8, seed=0))
    engine.step()  # sample 0 computes the prompt and samples; the other three are released to wait
    assert len(engine.scheduler.waiting) == 3 and engine.num_waiting_requests() == 1
    engine.add_request("b", {"prompt_token_ids": _prompt(12, 7)}, SamplingParams(max_tokens=4))
    assert engine.num_waiting_requests() == 2
    while engine.has_unfinished_requests():
        engine.step()
    _assert_pool_free(llm)


def test_abort_one_sample_lets_the_others_finish(llm):
    """What the split server's API process asks when a stop string ends one sample of n > 1."""
    engine, prompt = llm.engine, _prompt(40, seed=7)
    params = SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)
    whole = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    engine.add_request("ab", {"prompt_token_ids": prompt}, params)
    final, aborted = None, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
            if not aborted and len(out.outputs[1].token_ids) >= 3:
                assert engine.abort_sample("ab", 1)
                aborted = True
    assert aborted and final.finished
    assert [c.finish_reason for c in final.outputs] == ["length", "abort", "length"]
    assert final.outputs[1].token_ids == whole.outputs[1].token_ids[:3]
    for i in (0, 2):  # the siblings go on as if nothing happened
        assert final.outputs[i].token_ids == whole.outputs[i].token_ids
    assert not engine.has_request("ab") and not engine.abort_sample("ab", 0)
    _assert_pool_free(llm)
