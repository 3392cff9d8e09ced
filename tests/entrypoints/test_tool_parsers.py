"""tool_choice "auto": the hermes parser, whole and streamed in pieces of any size."""

from __future__ import annotations

import json

import pytest

from kvflow.entrypoints.openai.tool_parsers import HermesToolParser, make_tool_parser

TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>{"name": "ping", "arguments": "{}"}</tool_call>')
OUTPUTS = [
    TWO_CALLS,
    '<tool_call>\n{"name": "ping", "arguments": {}}',  # ended right after the JSON (EOS)
    "Paris is 18 degrees and sunny.",
    "if a < b and b <tool then\n",  # looks like a tag's start, twice, and is text
    'Text <tool_call>{"name": oops}</tool_call>',  # not JSON: text
    'Text <tool_call>["ping"]</tool_call>',  # JSON without a name: text
    "",
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


def test_whole_outputs():
    parser = HermesToolParser()
    content, calls, reason = parser.message(TWO_CALLS, "stop")
    assert (content, reason) == ("Let me check.", "tool_calls")
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("ping", {})]
    assert len({c.id for c in calls}) == 2
    assert parser.message('<tool_call>{"name": "ping", "arguments": {}}', "stop")[0] is None  # no text: null
    for text in OUTPUTS[2:]:
        assert parser.message(text, "length") == (text, None, "length")


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_in_pieces_is_the_whole_message(text, size):
    parser = HermesToolParser()
    want_content, want_calls, want_reason = parser.message(text, "stop")
    stream = parser.stream()
    content = ""
    for i in range(0, len(text), size):
        piece, calls = stream.delta(text[i:i + size])
        assert calls is None
        content += piece or ""
        assert "<tool_call>" not in content
    tail, calls, reason = stream.finish("stop")
    content += tail or ""
    assert (content, reason) == (want_content or "", want_reason)
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in calls or []] == \
        [(i, n, a) for i, (n, a) in enumerate(_calls(want_calls))]


def test_unknown_parser_names_the_choices():
    assert make_tool_parser(None) is None
    with pytest.raises(ValueError, match="^tool_call_parser: unknown parser 'qwen'; supported: hermes"):
        make_tool_parser("qwen")
