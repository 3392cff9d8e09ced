"""SamplingParams(prompt_logprobs=k): every prompt token scored as transformers scores it,
whatever the chunking, the prefix cache, preemption or the batch around the request."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.engine import prompt_logprobs as plp
from tests.conftest import save_tiny_llama

TOL = 1e-4  # absolute, on log-probabilities, float32 against transformers float32
K = 5


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at every position of `prompt`, float32."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_matches_reference(out, ref: torch.Tensor, k: int, label: str = "") -> None:
    """Entry i holds prompt token i and the top-k at position i - 1, all as the reference says."""
    prompt, entries = out.prompt_token_ids, out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt), label
    assert entries[0] is None, label
    for i in range(1, len(prompt)):
        entry, row, tok = entries[i], ref[i - 1], prompt[i]
        assert tok in entry and len(entry) in (k, k + 1), f"{label} position {i}: {entry}"
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(row[tid].item(), abs=TOL), f"{label} position {i} token {tid}"
        others = sorted((v for t, v in entry.items() if t != tok or len(entry) == k), key=lambda v: -v.logprob)[:k]
        assert [v.logprob for v in others] == pytest.approx(row.topk(k).values.tolist(), abs=TOL), \
            f"{label} position {i}: top-{k}"
        ranks = [v.rank for t, v in sorted(entry.items(), key=lambda tv: -tv[1].logprob) if t != tok]
        assert ranks == sorted(set(ranks)) and set(ranks) <= set(range(1, k + 1)), f"{label} position {i}: {ranks}"
        value = row[tok].item()  # the rank the reference gives, up to near-ties
        assert 1 + int((row > value + TOL).sum()) <= entry[tok].rank <= 1 + int((row > value - TOL).sum()), label


def assert_same_entries(a: list, b: list, label: str = "", tol: float = 1e-5) -> None:
    assert len(a) == len(b), f"{label}: {len(a)} entries vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"{label} position {i}"
            continue
        assert list(x) == list(y), f"{label} position {i}: {x} vs {y}"
        assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=tol), \
            f"{label} position {i}"
        assert [v.rank for v in x.values()] == [v.rank for v in y.values()], f"{label} position {i}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-prompt-logprobs"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (1, 2, 17, 100, 300)]


@pytest.fixture(scope="module")
def refs(tiny, prompts) -> list[torch.Tensor]:
    return [reference(tiny[1], p) for p in prompts]


def tiny_llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_model_len=512, **kw)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


PARAMS = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K)


# ---- values ---------------------------------------------------------------------------------------
def test_default_model_matches_transformers(smollm2_fp32, hf_smollm2):
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
            "movable metal type, oil-based ink and a wooden screw press. Within fifty years presses ran in more "
            "than two hundred European cities, and the price of books fell sharply.")
    out = smollm2_fp32.generate(text, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                                use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 40
    assert_matches_reference(out, reference(hf_smollm2, out.prompt_token_ids), 2, "SmolLM2")
    assert out.outputs[0].logprobs is None  # logprobs of the output stay off unless asked


def test_tiny_model_matches_transformers_whole_prompts(tiny, prompts, refs):
    outs = generate(tiny_llm(tiny[0], max_num_batched_tokens=1024), prompts, PARAMS)
    for out, ref in zip(outs, refs):
        assert_matches_reference(out, ref, K, f"{len(out.prompt_token_ids)} tokens")
    assert outs[0].prompt_logprobs == [None]  # a one-token prompt has nothing to score


def test_chunked_prefill_and_slices_give_the_same_values(tiny, prompts, refs, monkeypatch):
    """Chunks of 16 tokens shared by several requests, LM-head slices of 7 rows crossing requests."""
    monkeypatch.setattr(plp, "SLICE_ROWS", 7)
    llm = tiny_llm(tiny[0], max_num_batched_tokens=16, enable_prefix_caching=False)
    seen: list[int] = []
    compute_logits = llm.engine.runner.model.compute_logits
    llm.engine.runner.model.compute_logits = lambda h: (seen.append(h.shape[0]), compute_logits(h))[1]
    whole = generate(tiny_llm(tiny[0], max_num_batched_tokens=1024), prompts, PARAMS)
    chunked = generate(llm, prompts, PARAMS)
    assert max(seen) == 7
    for out, ref, base in zip(chunked, refs, whole):
        assert_matches_reference(out, ref, K, f"chunked {len(out.prompt_token_ids)} tokens")
        assert_same_entries(out.prompt_logprobs, base.prompt_logprobs, "chunked vs whole")
        assert out.outputs[0].token_ids == base.outputs[0].token_ids


def test_lm_head_never_sees_more_than_a_slice(tiny, prompts, monkeypatch):
    monkeypatch.setattr(plp, "SLICE_ROWS", 64)
    llm = tiny_llm(tiny[0], max_num_batched_tokens=512)
    seen: list[int] = []
    compute_logits = llm.engine.runner.model.compute_logits
    llm.engine.runner.model.compute_logits = lambda h: (seen.append(h.shape[0]), compute_logits(h))[1]
    generate(llm, [prompts[-1]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    # 299 scored rows in slices of at most 64, then the one sampled row
    assert seen == [64, 64, 64, 64, 43, 1]


def test_mixed_batch(tiny, prompts, refs):
    """Requests with and without prompt logprobs, and with other k, share steps; none disturbs another."""
    ks = [None, 0, 3, None, 20]
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=k) for k in ks]
    plain = generate(tiny_llm(tiny[0]), prompts, SamplingParams(temperature=0, max_tokens=4))
    outs = generate(tiny_llm(tiny[0], max_num_batched_tokens=48), prompts, params)
    for out, base, ref, k in zip(outs, plain, refs, ks):
        assert out.outputs[0].token_ids == base.outputs[0].token_ids
        if k is None:
            assert out.prompt_logprobs is None
        else:
            assert_matches_reference(out, ref, k, f"k={k}")


def test_temperature_and_penalties_do_not_change_prompt_logprobs(tiny, prompts, refs):
    """Raw model log-probabilities, as vLLM's default: sampling knobs apply to the output only."""
    params = SamplingParams(temperature=1.7, top_k=3, repetition_penalty=1.5, seed=0, max_tokens=2, prompt_logprobs=K)
    out = generate(tiny_llm(tiny[0]), [prompts[3]], params)[0]
    assert_matches_reference(out, refs[3], K, "sampled request")


# ---- the prefix cache ---------------------------------------------------------------------------
def test_prefix_cache_is_skipped_for_scoring_and_still_filled(tiny, prompts, refs):
    llm = tiny_llm(tiny[0])
    prompt = prompts[-1]
    warm = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=3))[0]
    assert warm.prompt_logprobs is None
    first, second = (generate(llm, [prompt], PARAMS)[0] for _ in range(2))
    for out in (first, second):
        assert out.num_cached_tokens == 0  # every position computed: it must be scored
        assert_matches_reference(out, refs[-1], K, "cached prompt")
        assert out.outputs[0].token_ids == warm.outputs[0].token_ids
    assert_same_entries(first.prompt_logprobs, second.prompt_logprobs, "repeat")

    fresh = tiny_llm(tiny[0])
    generate(fresh, [prompt], PARAMS)  # a scoring request still publishes its blocks
    after = generate(fresh, [prompt], SamplingParams(temperature=0, max_tokens=3))[0]
    assert after.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    fresh.engine.check_integrity()


# ---- preemption -----------------------------------------------------------------------------------
def _run_with_preemption(llm: LLM, prompt: list[int], steps_before: int):
    """Run one request, preempting it (as the scheduler does) after `steps_before` steps."""
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": prompt}, PARAMS)
    seq = engine._requests["r"].seq
    for _ in range(steps_before):
        engine.step()
    engine.scheduler._preempt(seq)
    scored = len(seq.prompt_logprobs)
    cached = engine.kv_cache_manager.find_cached_prefix(seq)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert seq.num_preemptions == 1 and final is not None and final.finished
    engine.check_integrity()
    return final, scored, len(cached) * engine.kv_cache_manager.block_size


@pytest.mark.parametrize(("budget", "caching"), [(32, True), (20, True), (20, False)])
def test_preemption_mid_prompt_neither_duplicates_nor_loses(tiny, prompts, refs, budget, caching):
    """The recompute starts at 0, or at a cached block boundary before the last scored position."""
    llm = tiny_llm(tiny[0], max_num_batched_tokens=budget, enable_prefix_caching=caching)
    out, scored, cached = _run_with_preemption(llm, prompts[-1], steps_before=3)
    assert scored == 1 + 3 * budget  # None, then one entry per computed position
    assert cached == ((scored - 1) // 16 * 16 if caching else 0)  # only positions already scored
    assert_matches_reference(out, refs[-1], K, "preempted mid-prompt")


def test_preemption_after_prompt_reuses_the_cache(tiny, prompts, refs):
    llm = tiny_llm(tiny[0], max_num_batched_tokens=512)
    out, scored, cached = _run_with_preemption(llm, prompts[-1], steps_before=2)
    assert scored == len(prompts[-1])
    # Scoring is done: every full block of prompt and first output token is fair game.
    assert cached == (len(prompts[-1]) + 1) // 16 * 16
    assert_matches_reference(out, refs[-1], K, "preempted while decoding")


def test_preemption_under_memory_pressure(tiny):
    """A pool for about two requests (as tests/engine/test_preemption.py): every prompt fully scored."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(8, 60))] for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16, prompt_logprobs=1)
    base = generate(LLM(tiny[0], dtype="float32", kv_cache_memory=4 << 20, max_model_len=80), prompts, params)
    probe = LLM(tiny[0], dtype="float32", kv_cache_memory=1 << 20, max_model_len=80)
    llm = LLM(tiny[0], dtype="float32", kv_cache_memory=2 * 80 * probe.engine.plan.bytes_per_token, max_model_len=80,
              max_num_batched_tokens=24)
    llm.engine.scheduler.config.admission_headroom_blocks = 0
    outs = generate(llm, prompts, params)
    assert llm.engine.get_stats().num_preemptions > 0
    for out, ref in zip(outs, base):
        assert_same_entries(out.prompt_logprobs, ref.prompt_logprobs, "under pressure")
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    llm.engine.check_integrity()


# ---- speculative decoding leaves prefill rows alone ------------------------------------------------
def test_with_ngram_speculation(tiny, prompts, refs):
    llm = tiny_llm(tiny[0], speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    out = generate(llm, [prompts[3]], PARAMS)[0]
    assert_matches_reference(out, refs[3], K, "speculating")
