"""Beam search (`LLM.beam_search`) against a plain beam search over transformers' logits in fp32:
the same beams, in the same order, with the same cumulative logprobs."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

from kvflow import LLM, BeamSearchParams, Logprob, SamplingParams

EOS = 2  # the tiny models' eos_token_id (LlamaConfig's default)


def prompts(seed: int, count: int, lo: int = 5, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def reference(hf, prompt: list[int], width: int, max_tokens: int, length_penalty: float = 1.0,
              ignore_eos: bool = False, eos: int = EOS) -> list[tuple[list[int], float]]:
    """Each beam's whole sequence through the model every step, the top 2 x width next tokens as
    candidates, vLLM's score (cum logprob / length ** length_penalty, a final EOS not counted)."""
    def score(tokens, cum):
        return cum / ((len(tokens) - (tokens[-1] == eos)) ** length_penalty)

    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            top = torch.topk(logprobs, 2 * width)
            for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
                (done if tid == eos and not ignore_eos else candidates).append((tokens + [tid], cum + lp))
        beams = sorted(candidates, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(done + beams, key=lambda b: score(*b), reverse=True)[:width]


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[0], dtype="float32")


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_matches_a_plain_beam_search(tiny, llm, width, length_penalty):
    _, hf = tiny
    ps = prompts(width, 3)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in ps],
                           BeamSearchParams(beam_width=width, max_tokens=8, length_penalty=length_penalty))
    for p, out in zip(ps, outs):
        expected = reference(hf, p, width, 8, length_penalty)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in expected]
        for s, (_, cum) in zip(out.sequences, expected):
            assert math.isclose(s.cum_logprob, cum, rel_tol=1e-4, abs_tol=1e-4)
            assert s.finish_reason == ("stop" if s.tokens[-1] == EOS else "length")
            assert len(s.logprobs) == len(s.tokens) - len(p)
    engine = llm.engine
    engine.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def eos_model(tiny, tmp_path_factory):
    """The tiny model with the token greedy decoding picks third as its EOS: finished beams occur."""
    path, hf = tiny
    prompt = prompts(11, 1)[0]
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)[0, len(prompt):].tolist()
    folder = tmp_path_factory.mktemp("eos-model")
    shutil.copytree(path, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = greedy[2]
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder), hf, prompt, greedy[2]


@pytest.mark.parametrize("length_penalty", [1.0, 2.0])
def test_finished_beams_compete_with_live_ones(eos_model, length_penalty):
    path, hf, prompt, eos = eos_model
    out = LLM(path, dtype="float32").beam_search({"prompt_token_ids": prompt}, BeamSearchParams(
        beam_width=3, max_tokens=8, length_penalty=length_penalty))[0]
    expected = reference(hf, prompt, 3, 8, length_penalty, eos=eos)
    assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in expected]
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped and all(s.tokens[-1] == eos and s.stop_reason == eos for s in stopped)


def test_width_one_without_eos_is_greedy(llm):
    p = prompts(7, 1)[0]
    beam = llm.beam_search({"prompt_token_ids": p}, BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))
    greedy = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)
    assert beam[0].sequences[0].tokens == p + greedy[0].outputs[0].token_ids


def test_same_beams_alone_or_batched(llm):
    ps = prompts(8, 4)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    together = llm.beam_search([{"prompt_token_ids": p} for p in ps], params)
    for p, out in zip(ps, together):
        alone = llm.beam_search({"prompt_token_ids": p}, params)[0]
        assert [s.tokens for s in alone.sequences] == [s.tokens for s in out.sequences]


def test_stops_at_max_model_len(tiny):
    llm = LLM(tiny[0], dtype="float32", max_model_len=24)
    p = prompts(9, 1, 20, 20)[0]
    out = llm.beam_search({"prompt_token_ids": p}, BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))
    assert [len(s.tokens) for s in out[0].sequences] == [24, 24]
    assert {s.finish_reason for s in out[0].sequences} == {"length"}


def test_text_of_the_default_model(smollm2_fp32):
    out = smollm2_fp32.beam_search(["The capital of France is"], BeamSearchParams(beam_width=2, max_tokens=4))
    tokenizer = smollm2_fp32.get_tokenizer()
    for s in out[0].sequences:
        generated = s.tokens[len(tokenizer("The capital of France is").input_ids):]
        assert s.text == tokenizer.decode(generated[:-1] if s.finish_reason == "stop" else generated)


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_width=0, max_tokens=4), r"beam_width must be an int in \[1, 10\]"),
    (dict(beam_width=11, max_tokens=4), r"beam_width must be an int in \[1, 10\]"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be a positive int"),
    (dict(beam_width=2, max_tokens=4, temperature=-1), "temperature must be >= 0"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be a finite number"),
])
def test_refused_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=False, **_):
        return "".join(f"<{i}>" for i in ids)


def test_score_leaves_a_final_eos_out_of_the_length():
    from kvflow.sampling.beam_search import BeamSearchSequence, beam_score

    assert beam_score(BeamSearchSequence([5, 6, 7, EOS], cum_logprob=-6.0), [EOS], 1.0) == -2.0
    assert beam_score(BeamSearchSequence([5, 6, 7, 8], cum_logprob=-6.0), [EOS], 1.0) == -1.5
    assert beam_score(BeamSearchSequence([5, 6, 7, 8], cum_logprob=-6.0), [EOS], 2.0) == -6.0 / 16


@pytest.mark.parametrize(("length_penalty", "cum_logprob", "score"), [
    (1000.0, -6.0, -0.0), (1e308, -6.0, -0.0), (-1000.0, -6.0, -math.inf), (-1000.0, 0.0, 0.0)])
def test_score_at_powers_beyond_float_range(length_penalty, cum_logprob, score):
    """4 ** 1000 overflows Python's float power (a 500 from the server before): the limit instead."""
    from kvflow.sampling.beam_search import BeamSearchSequence, beam_score

    assert beam_score(BeamSearchSequence([5, 6, 7, 8], cum_logprob=cum_logprob), [EOS], length_penalty) == score


def _entry(logprobs: dict[int, float]) -> dict[int, Logprob]:
    """One step's engine entry for a beam (the sampler's records; the search reads `.logprob`)."""
    return {t: Logprob(v) for t, v in logprobs.items()}


@pytest.mark.parametrize("include_stop", [False, True])
def test_state_machine_by_hand(include_stop):
    """Two steps of width 2 with EOS among the candidates: EOS ends a beam, the rest compete."""
    from kvflow.sampling.beam_search import BeamSearch

    search = BeamSearch([10, 11], BeamSearchParams(beam_width=2, max_tokens=2, include_stop_str_in_output=include_stop),
                        [EOS], max_model_len=100)
    search.advance([_entry({20: -0.1, EOS: -0.2, 21: -1.0, 22: -3.0})])
    assert [b.tokens for b in search.beams] == [[10, 11, 20], [10, 11, 21]]
    assert [c.tokens for c in search.completed] == [[10, 11, EOS]]
    search.advance([_entry({30: -0.5, 31: -2.0}), _entry({32: -0.1, 33: -0.2})])
    assert search.done
    out = search.result(_Tokenizer()).sequences
    # scores: EOS beam -0.2/2 = -0.1; [20, 30] -0.6/4 = -0.15; [21, 32] -1.1/4 = -0.275
    assert [s.tokens[2:] for s in out] == [[EOS], [20, 30]]
    assert [s.finish_reason for s in out] == ["stop", "length"]
    assert out[0].text == (f"<{EOS}>" if include_stop else "") and out[1].text == "<20><30>"
    # the steps ran without text; the returned beams' logprobs name their tokens (vLLM's Logprob)
    assert [{t: lp.decoded_token for t, lp in step.items()} for step in out[1].logprobs] == [
        {20: "<20>", EOS: f"<{EOS}>", 21: "<21>", 22: "<22>"}, {30: "<30>", 31: "<31>"}]
