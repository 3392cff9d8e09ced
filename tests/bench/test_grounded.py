"""W-grounded (kvflow.bench.grounded): deterministic chat prompts over kvflow's own source.

Tokenizer only (the default model's), no model forward: the quoting rate of real outputs is
what scripts/grounded_overlap.py measures.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvflow.bench import grounded
from kvflow.bench.datasets import BenchRequest, grounded_requests
from tests.conftest import smollm2_path

SYSTEM_AND_TEMPLATE_TOKENS = 80  # chat template, default system prompt and the longest instruction, generously


@pytest.fixture(scope="module")
def tokenizer():
    from kvflow.loader.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path())


@pytest.fixture(scope="module")
def requests16(tokenizer):
    return grounded_requests(tokenizer, num_prompts=16, seed=0, output_len=128)


def test_same_seed_same_token_ids_and_fingerprint(tokenizer, requests16):
    again = grounded_requests(tokenizer, num_prompts=16, seed=0, output_len=128)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests16]
    assert grounded.workload_fingerprint(again) == grounded.workload_fingerprint(requests16)
    other = grounded_requests(tokenizer, num_prompts=16, seed=1, output_len=128)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in requests16]
    assert grounded.workload_fingerprint(other) != grounded.workload_fingerprint(requests16)


def test_fingerprint_covers_token_ids_and_output_len():
    a = [BenchRequest([1, 2, 3], 8)]
    fp = grounded.workload_fingerprint(a)
    assert len(fp) == 64 and fp == grounded.workload_fingerprint([BenchRequest([1, 2, 3], 8)])
    assert fp != grounded.workload_fingerprint([BenchRequest([1, 2, 4], 8)])
    assert fp != grounded.workload_fingerprint([BenchRequest([1, 2, 3], 9)])
    assert grounded.workload_fingerprint([BenchRequest([1], 2), BenchRequest([3], 4)]) != \
        grounded.workload_fingerprint([BenchRequest([1, 2], 3), BenchRequest([], 4)])


def test_the_three_kinds_are_mixed_evenly(tokenizer, requests16):
    counts = Counter(r.kind for r in requests16)
    assert set(counts) == set(grounded.KINDS)
    assert max(counts.values()) - min(counts.values()) <= 1
    first3 = grounded_requests(tokenizer, num_prompts=3, seed=5)
    assert [r.kind for r in first3] == list(grounded.KINDS)


def test_each_kind_alternates_its_two_instructions(requests16):
    def template(instruction: str) -> str:
        return re.sub(r"`\w+`", "`X`", instruction)

    for kind in grounded.KINDS:
        used = Counter(template(r.instruction) for r in requests16 if r.kind == kind)
        assert len(used) == 2 and max(used.values()) - min(used.values()) <= 1, (kind, used)


def test_a_longer_draw_starts_with_the_shorter_one(tokenizer, requests16):
    longer = grounded_requests(tokenizer, num_prompts=24, seed=0, output_len=128)
    assert grounded.workload_fingerprint(longer[:16]) == grounded.workload_fingerprint(requests16)


def test_lengths_in_range_and_passages_distinct(tokenizer, requests16):
    low, high = grounded.PASSAGE_TOKENS
    for r in requests16:
        passage = len(tokenizer(r.passage, add_special_tokens=False).input_ids)
        assert low <= passage <= high, r.source
        assert low < len(r.prompt_token_ids) <= high + SYSTEM_AND_TEMPLATE_TOKENS, r.source
        assert r.output_len == 128
    assert len({r.source for r in requests16}) == len(requests16)


def test_prompts_are_chat_templated_user_turns(tokenizer, requests16):
    for r in requests16:
        content = f"{r.instruction}\n\n" + (f"```python\n{r.passage}\n```" if r.kind != "summarize" else r.passage)
        expected = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
        assert tokenizer.decode(r.prompt_token_ids) == expected
        assert expected.startswith("<|im_start|>") and expected.endswith("<|im_start|>assistant\n")
        assert r.prompt_token_ids == tokenizer(expected, add_special_tokens=False).input_ids


def test_passages_come_from_the_shipped_sources(requests16):
    root = grounded.package_root()
    for r in requests16:
        path, _, _ = r.source.partition(":")
        rel = path.removeprefix("kvflow/")
        assert rel.startswith(grounded.SOURCES), r.source
        text = (root / rel).read_text()
        if r.kind == "summarize":
            assert r.source.split(":")[1] == "docstrings"
            first = r.passage.split("\n\n")[0]
            assert all(line.strip() in text for line in first.splitlines())
        else:
            assert all(line.strip() in text for line in r.passage.splitlines())


def test_instructions_name_real_identifiers(requests16):
    assert {r.instruction.split("`")[0] for r in requests16 if r.kind == "summarize"} <= \
        {grounded.SUMMARIZE, grounded.SPELLING}
    for r in requests16:
        if "renamed to" in r.instruction:
            old, new = re.findall(r"`(\w+)`", r.instruction)
            assert len(re.findall(rf"\b{old}\b", r.passage)) >= 2 and not re.search(rf"\b{new}\b", r.passage)
        elif r.instruction.startswith("Copy every line"):
            (word,) = re.findall(r"`(\w+)`", r.instruction)
            lines = [ln for ln in r.passage.splitlines() if re.search(rf"\b{word}\b", ln)]
            assert 2 <= len(lines) < len([ln for ln in r.passage.splitlines() if ln.strip()])


def test_warmup_draw_can_exclude_the_timed_passages(tokenizer):
    """`kvflow bench throughput`'s default 32 prompts, and a warm-up draw of as many sharing no passage."""
    timed = grounded_requests(tokenizer, num_prompts=32, seed=0)
    warmup = grounded_requests(tokenizer, num_prompts=32, seed=100, exclude=timed)
    assert not {r.source for r in warmup} & {r.source for r in timed}


def test_too_many_prompts_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="not enough"):
        grounded_requests(tokenizer, num_prompts=1000)


def test_datasets_helper_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        grounded_requests(None)


def test_prompt_lookup_hits():
    # Output continues a span of the prompt: each token after the first two is predicted.
    prompt = [1, 2, 3, 4, 5, 6, 9]
    assert grounded.prompt_lookup_hits(prompt, [2, 3, 4, 5, 7]) == [False, False, True, True, False]
    # The latest earlier occurrence wins: after (1, 2) the prompt had 3, then later 8.
    assert grounded.prompt_lookup_hits([1, 2, 3, 1, 2, 8, 0, 1, 2], [8, 3]) == [True, False]
    # The longest matching suffix wins over a shorter one with a later occurrence.
    assert grounded.prompt_lookup_hits([5, 1, 2, 7, 0, 1, 2, 9, 5, 1, 2], [7]) == [True]
    # Its own output counts as context too (a repetition loop is predicted).
    assert grounded.prompt_lookup_hits([0], [4, 5, 4, 5, 4]) == [False, False, False, False, True]
    assert grounded.prompt_lookup_hits([], []) == []
