"""The default model, fp32, against transformers token for token (tie rule in conftest)."""

from __future__ import annotations

import pytest

from kvflow import SamplingParams
from tests.conftest import assert_greedy_match, hf_greedy
from tests.engine.prompts import OWN_PROMPTS, OWN_TOKENS

# min_tokens == max_tokens: EOS is masked, exactly as the reference's min_new_tokens did.
GREEDY_48 = SamplingParams(temperature=0, max_tokens=48, min_tokens=48, logprobs=10)



def test_reference_prompts_greedy_48(smollm2_fp32, reference):
    rows = reference["prompts"]
    outs = smollm2_fp32.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows], GREEDY_48, use_tqdm=False)
    for row, out in zip(rows, outs):
        assert_greedy_match(out.outputs[0].token_ids, row["greedy_48_ignore_eos"], row["greedy_48_top2_gap"], row["prompt"][-40:])


def test_reference_first_step_logits(smollm2_fp32, reference):
    """Logit differences (our API gives log-probabilities, which differ from logits by a constant)."""
    rows = reference["prompts"]
    outs = smollm2_fp32.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows],
                                 SamplingParams(temperature=0, max_tokens=1, logprobs=10), use_tqdm=False)
    for row, out in zip(rows, outs):
        ours = out.outputs[0].logprobs[0]
        ids, logits = row["first_step_top10_ids"], row["first_step_top10_logits"]
        assert set(ids) <= set(ours), "top-10 token set differs"
        for tid, logit in zip(ids[1:], logits[1:]):
            ref_diff = logit - logits[0]
            our_diff = ours[tid].logprob - ours[ids[0]].logprob
            assert our_diff == pytest.approx(ref_diff, abs=1e-3 * abs(logits[0]))


def test_reference_natural_greedy_stops_at_eos(smollm2_fp32, reference):
    rows = reference["prompts"]
    outs = smollm2_fp32.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows],
                                 SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    for row, out in zip(rows, outs):
        ours, ref = out.outputs[0].token_ids, row["greedy_natural"]
        if ours[:48] == row["greedy_48_ignore_eos"][: len(ours[:48])] or ours == ref:
            assert ours == ref
            assert out.outputs[0].finish_reason == ("stop" if ref[-1] == reference["meta"]["eos_token_id"] else "length")
            if ref[-1] == reference["meta"]["eos_token_id"]:
                assert out.outputs[0].text == row["greedy_natural_text"]


def test_chat_template_and_text(smollm2_fp32, reference):
    row = next(r for r in reference["prompts"] if r["kind"] == "chat")
    out = smollm2_fp32.chat(row["messages"], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert out.prompt_token_ids == row["prompt_token_ids"]
    assert out.outputs[0].text == row["greedy_natural_text"]


def test_own_prompts_against_stored_transformers_outputs(smollm2_fp32, extra_reference):
    rows = extra_reference["own"]
    assert [r["prompt"] for r in rows] == OWN_PROMPTS
    outs = smollm2_fp32.generate(OWN_PROMPTS, SamplingParams(temperature=0, max_tokens=OWN_TOKENS, min_tokens=OWN_TOKENS),
                                 use_tqdm=False)
    for row, out in zip(rows, outs):
        assert out.prompt_token_ids == row["prompt_token_ids"]
        assert_greedy_match(out.outputs[0].token_ids, row["tokens"], row["gaps"], row["prompt"])
    smollm2_fp32.engine.check_integrity()


def test_live_transformers_agrees(smollm2_fp32, hf_smollm2, extra_reference):
    """Computed now with the installed transformers: keeps the stored references honest."""
    for row in extra_reference["own"][:2]:
        ref, gaps, _ = hf_greedy(hf_smollm2, row["prompt_token_ids"], 12)
        assert_greedy_match(row["tokens"][:12], ref, gaps, "stored vs live reference")
        out = smollm2_fp32.generate({"prompt_token_ids": row["prompt_token_ids"]},
                                    SamplingParams(temperature=0, max_tokens=12, min_tokens=12), use_tqdm=False)[0]
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, row["prompt"])
