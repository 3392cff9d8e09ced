"""The logprob wire formats: -inf (a token a mask ruled out) leaves as vLLM's -9999.0, never as null."""

from __future__ import annotations

import json

from kvflow.entrypoints.openai.logprobs import LOGPROB_FLOOR, chat_logprobs, completion_logprobs, echo_logprobs
from kvflow.loader.tokenizer import token_bytes
from kvflow.outputs import Logprob

INF = float("-inf")


def lps(entry: dict[int, float] | None) -> dict[int, Logprob] | None:
    """An engine entry from {token: logprob}, ranked by value as the sampler ranks the top k."""
    if entry is None:
        return None
    order = sorted(entry, key=lambda t: -entry[t])
    return {t: Logprob(v, order.index(t) + 1) for t, v in entry.items()}


def test_masked_tokens_leave_as_the_floor_in_both_shapes():
    ids, entries = [5, 6], [lps({5: -0.5, 9: INF}), lps({6: -0.1, 7: -2.0})]
    chat = chat_logprobs(ids, entries, 2, lambda t: f"<{t}>", lambda t: f"<{t}>".encode())
    assert [t.logprob for t in chat.content[0].top_logprobs] == [-0.5, LOGPROB_FLOOR]
    assert "null" not in chat.model_dump_json()
    legacy = completion_logprobs(ids, entries, 2, lambda t: f"<{t}>", offset=3)
    assert legacy.top_logprobs[0] == {"<5>": -0.5, "<9>": LOGPROB_FLOOR}
    assert legacy.text_offset == [3, 6] and legacy.token_logprobs == [-0.5, -0.1]
    json.loads(legacy.model_dump_json())


def test_echo_gives_nulls_where_nothing_scored_the_token():
    echoed = echo_logprobs([1, 2], [None, lps({2: -1.0, 3: INF})], 1, str)
    assert echoed.token_logprobs == [None, -1.0] and echoed.top_logprobs == [None, {"2": -1.0}]
    assert echo_logprobs([1, 2], None, 1, str).token_logprobs == [None, None]


def test_a_token_inside_a_character_gives_its_own_bytes(smollm2_fp32):
    """OpenAI's `bytes` rebuild an emoji split over tokens; the tokens' text alone is U+FFFD each."""
    tok = smollm2_fp32.get_tokenizer()
    ids = tok("I \U0001F600", add_special_tokens=False).input_ids
    pieces = [token_bytes(tok, t) for t in ids]
    assert b"".join(pieces).decode("utf-8") == "I \U0001F600"
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids)  # what the bytes were made from before
    chat = chat_logprobs(ids, [lps({t: -0.5}) for t in ids], 1, tok.decode, lambda t: token_bytes(tok, t))
    assert bytes(b for entry in chat.content for b in entry.bytes).decode("utf-8") == "I \U0001F600"
    assert token_bytes(tok, tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


def test_completion_top_logprobs_hold_the_chosen_token_too():
    """OpenAI: 'the API will always return the logprob of the sampled token, so there may be up to
    logprobs+1 elements'; with logprobs=0, the chosen token alone (vLLM sends the same)."""
    ids, entries = [5, 6], [lps({5: -2.0, 9: -0.1, 3: -1.0}), lps({6: -0.2, 7: -2.0})]
    legacy = completion_logprobs(ids, entries, 1, lambda t: f"<{t}>")
    assert legacy.top_logprobs == [{"<9>": -0.1, "<5>": -2.0}, {"<6>": -0.2}]
    assert completion_logprobs(ids, entries, 0, lambda t: f"<{t}>").top_logprobs == [{"<5>": -2.0}, {"<6>": -0.2}]

