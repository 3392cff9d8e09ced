"""The logprob wire formats: -inf (a token a mask ruled out) leaves as vLLM's -9999.0, never as null."""

from __future__ import annotations

import json

from kvflow.entrypoints.openai.logprobs import LOGPROB_FLOOR, chat_logprobs, completion_logprobs, echo_logprobs

INF = float("-inf")


def test_masked_tokens_leave_as_the_floor_in_both_shapes():
    ids, entries = [5, 6], [{5: -0.5, 9: INF}, {6: -0.1, 7: -2.0}]
    chat = chat_logprobs(ids, entries, 2, lambda t: f"<{t}>")
    assert [t.logprob for t in chat.content[0].top_logprobs] == [-0.5, LOGPROB_FLOOR]
    assert "null" not in chat.model_dump_json()
    legacy = completion_logprobs(ids, entries, 2, lambda t: f"<{t}>", offset=3)
    assert legacy.top_logprobs[0] == {"<5>": -0.5, "<9>": LOGPROB_FLOOR}
    assert legacy.text_offset == [3, 6] and legacy.token_logprobs == [-0.5, -0.1]
    json.loads(legacy.model_dump_json())


def test_echo_gives_nulls_where_nothing_scored_the_token():
    echoed = echo_logprobs([1, 2], [None, {2: -1.0, 3: INF}], 1, str)
    assert echoed.token_logprobs == [None, -1.0] and echoed.top_logprobs == [None, {"2": -1.0}]
    assert echo_logprobs([1, 2], None, 1, str).token_logprobs == [None, None]
