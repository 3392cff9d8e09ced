"""tool_choice "auto": the hermes, llama3_json and mistral parsers, whole and streamed in pieces of any size."""

from __future__ import annotations

import json

import pytest

from kvflow.entrypoints.openai.tool_parsers import (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                                    make_tool_parser)

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


LLAMA3 = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "ping", "parameters": {}}',
    '<|python_tag|>{"name": "ping", "parameters": {}}',
    '  {"name": "ping", "arguments": {"x": 1}}',
    "Paris is 18 degrees and sunny.",
    '{"name": "ping", "parameters": {}} and then some text',  # trailing text: not calls
    '{"no": "name"}',
    "<|python",  # cut short inside the tag: text
    "",
]
MISTRAL = [
    'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "ping", "arguments": {}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]ping[ARGS]{}',
    '[TOOL_CALLS] {"name": "ping", "arguments": {}}',
    "Paris is 18 degrees [TOOL not a call",
    '[TOOL_CALLS][{"name": "ping", "arguments": {}}] trailing',  # trailing text: not calls
    "[TOOL_CALLS]ping[ARGS]{not json",
    "",
]
CASES = ([(HermesToolParser, t) for t in OUTPUTS] + [(Llama3JsonToolParser, t) for t in LLAMA3]
         + [(MistralToolParser, t) for t in MISTRAL])


def test_llama3_and_mistral_whole_outputs():
    llama = Llama3JsonToolParser()
    content, calls, reason = llama.message(LLAMA3[0], "stop")
    assert (content, reason) == (None, "tool_calls")
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("ping", {})]
    assert _calls(llama.message(LLAMA3[1], "stop")[1]) == [("ping", {})]
    assert _calls(llama.message(LLAMA3[2], "stop")[1]) == [("ping", {"x": 1})]
    for text in LLAMA3[3:]:
        assert llama.message(text, "length") == (text, None, "length")
    mistral = MistralToolParser()
    content, calls, reason = mistral.message(MISTRAL[0], "stop")
    assert (content, reason) == ("Checking.", "tool_calls")
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("ping", {})]
    assert _calls(mistral.message(MISTRAL[1], "stop")[1]) == [("get_weather", {"city": "Paris"}), ("ping", {})]
    assert _calls(mistral.message(MISTRAL[2], "stop")[1]) == [("ping", {})]
    for text in MISTRAL[3:]:
        assert mistral.message(text, "length") == (text, None, "length")


def test_mistral_requests_keep_special_tokens():
    """[TOOL_CALLS] is a special token: a request the mistral parser reads must keep it in its text."""
    from kvflow.entrypoints.openai.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)
    body.use_tool_parser(MistralToolParser())
    assert body.skip_special_tokens is False
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="none")
    plain.use_tool_parser(MistralToolParser())
    assert plain.skip_special_tokens is True
    hermes = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)
    hermes.use_tool_parser(HermesToolParser())
    assert hermes.skip_special_tokens is True


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("parser_class", "text"), CASES)
def test_streamed_in_pieces_is_the_whole_message(parser_class, text, size):
    parser = parser_class()
    want_content, want_calls, want_reason = parser.message(text, "stop")
    stream = parser.stream()
    content = ""
    for i in range(0, len(text), size):
        piece, calls = stream.delta(text[i:i + size])
        assert calls is None
        content += piece or ""
        if want_calls:  # nothing of a call ever goes out as text
            assert len(content) <= len(want_content or "")
    tail, calls, reason = stream.finish("stop")
    content += tail or ""
    assert (content, reason) == (want_content or "", want_reason)
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in calls or []] == \
        [(i, n, a) for i, (n, a) in enumerate(_calls(want_calls))]


def test_unknown_parser_names_the_choices():
    assert make_tool_parser(None) is None
    supported = "hermes, llama3_json, mistral"
    with pytest.raises(ValueError, match=f"^tool_call_parser: unknown parser 'qwen'; supported: {supported}"):
        make_tool_parser("qwen")
