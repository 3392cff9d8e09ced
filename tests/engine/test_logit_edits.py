"""logit_bias, allowed_token_ids and bad_words on the default model, through `LLM`.

Each edit is checked against the plain greedy run of the same prompt: what it must change and
what it must leave alone; in a batch beside plain requests, with parallel samples and under
n-gram speculation (whose drafts the bans must see as output).
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0, max_tokens=24)


def _run(llm: LLM, params: SamplingParams, prompt: str = PROMPT):
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    return out


@pytest.fixture(scope="module")
def plain(smollm2_fp32):
    return _run(smollm2_fp32, SamplingParams(**GREEDY, logprobs=2))


def test_a_minus_100_bias_on_the_greedy_token_gives_the_runner_up(smollm2_fp32, plain):
    first = plain.token_ids[0]
    runner_up = next(t for t in plain.logprobs[0] if t != first)
    out = _run(smollm2_fp32, SamplingParams(**GREEDY, logit_bias={str(first): -100}))
    assert out.token_ids[0] == runner_up
    assert first not in out.token_ids


def test_a_plus_100_bias_takes_over(smollm2_fp32):
    token = smollm2_fp32.engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = _run(smollm2_fp32, SamplingParams(**GREEDY, logit_bias={token: 100}))
    assert out.token_ids == [token] * GREEDY["max_tokens"]


def test_bad_words_of_one_and_of_two_tokens(smollm2_fp32, plain):
    tokenizer = smollm2_fp32.engine.tokenizer
    assert plain.text.startswith(" Paris")
    out = _run(smollm2_fp32, SamplingParams(**GREEDY, bad_words=["Paris"]))
    assert "Paris" not in out.text
    # Without "Paris" the model goes on " the capital of the French Republic"; ban the last two words.
    assert out.text.startswith(" the capital of the French Republic")
    banned = _run(smollm2_fp32, SamplingParams(**GREEDY, bad_words=["Paris", "French Republic"]))
    two = tokenizer.encode(" French Republic", add_special_tokens=False)
    assert len(two) == 2
    assert banned.text.startswith(" the capital of the French") and "French Republic" not in banned.text
    # Everything before the ban took effect is the run with "Paris" alone banned.
    cut = out.token_ids.index(two[1])
    assert banned.token_ids[:cut] == out.token_ids[:cut] and banned.token_ids[cut] != two[1]


def test_allowed_token_ids_confine_the_output(smollm2_fp32, plain):
    allowed = sorted(set(plain.token_ids[::2]))
    for params in (SamplingParams(**GREEDY, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=24, allowed_token_ids=allowed)):
        assert set(_run(smollm2_fp32, params).token_ids) <= set(allowed)


def test_edited_and_plain_requests_in_one_batch(smollm2_fp32, plain):
    prompts = [PROMPT, "Water boils at", PROMPT, "Name three colors:"]
    params = [SamplingParams(**GREEDY, bad_words=["Paris"]), SamplingParams(**GREEDY, logit_bias={198: -5}),
              SamplingParams(**GREEDY), SamplingParams(**GREEDY, allowed_token_ids=list(range(300, 400)))]
    batched = [o.outputs[0].token_ids for o in smollm2_fp32.generate(prompts, params, use_tqdm=False)]
    alone = [_run(smollm2_fp32, p, prompt).token_ids for prompt, p in zip(prompts, params)]
    assert batched == alone
    assert batched[2] == plain.token_ids


def test_every_parallel_sample_keeps_the_ban(smollm2_fp32):
    out = smollm2_fp32.generate([PROMPT], SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=12,
                                                         bad_words=["Paris"]), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and not any("Paris" in o.text for o in out.outputs)


def test_speculative_decoding_sees_the_drafts_as_output():
    """N-gram drafts copy the prompt's repeats, so the bans must apply to a row whose output
    already holds the row's earlier drafts: the same tokens as without speculation."""
    prompt = "Say it again and again: the red fox runs, the red fox runs, the red fox runs, the red fox runs,"
    params = SamplingParams(temperature=0, max_tokens=24, bad_words=["fox runs"], logit_bias={13: -2.0})
    kwargs = dict(dtype="float32", kv_cache_memory=64 << 20, max_model_len=512)
    want = _run(LLM(**kwargs), params, prompt)
    spec = LLM(**kwargs, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                             "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                             "disable_by_batch_size": None})
    got = _run(spec, params, prompt)
    assert got.token_ids == want.token_ids
    assert spec.engine.get_stats().spec_decode.num_accepted_tokens > 0
    assert "fox runs" not in got.text and "fox runs" in _run(spec, SamplingParams(temperature=0, max_tokens=24),
                                                              prompt).text


@pytest.mark.parametrize(("params", "message"), [
    (dict(logit_bias={49152: 1.0}), r"^logit_bias token ids must be in \[0, 49152\)"),
    (dict(allowed_token_ids=[5, 10**6]), r"^allowed_token_ids token ids must be in \[0, 49152\)"),
])
def test_token_ids_past_the_vocabulary_are_refused(smollm2_fp32, params, message):
    with pytest.raises(ValueError, match=message):
        smollm2_fp32.generate([PROMPT], SamplingParams(**GREEDY, **params), use_tqdm=False)
    kv = smollm2_fp32.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not smollm2_fp32.engine.has_unfinished_requests()
