"""W-chat (kvflow.bench.chat): open questions in the chat template, drawn by seed."""

from __future__ import annotations

import pytest

from kvflow.bench.chat import QUESTIONS, chat_requests
from tests.conftest import smollm2_path


@pytest.fixture(scope="module")
def tokenizer():
    from kvflow.loader.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path())


def test_a_draw_is_the_questions_in_the_chat_template(tokenizer):
    requests = chat_requests(tokenizer, num_prompts=12, seed=0, output_len=64)
    assert len(requests) == 12 and all(r.output_len == 64 for r in requests)
    texts = [tokenizer.decode(r.prompt_token_ids) for r in requests]
    assert len(set(texts)) == 12
    for text in texts:
        assert text.rstrip().endswith("assistant")  # ready for the answer
        assert sum(q in text for q in QUESTIONS) == 1
    again = chat_requests(tokenizer, num_prompts=12, seed=0, output_len=64)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]
    assert [r.prompt_token_ids for r in chat_requests(tokenizer, 12, seed=1)] != [r.prompt_token_ids for r in requests]


def test_the_warm_up_shares_no_question_with_the_timed_set(tokenizer):
    timed = chat_requests(tokenizer, num_prompts=12, seed=0)
    warm = chat_requests(tokenizer, num_prompts=12, seed=100, exclude=timed)
    assert not {tuple(r.prompt_token_ids) for r in warm} & {tuple(r.prompt_token_ids) for r in timed}
    with pytest.raises(ValueError, match="lower --num-prompts"):
        chat_requests(tokenizer, num_prompts=13, seed=100, exclude=timed)
