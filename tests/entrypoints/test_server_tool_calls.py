"""Forced function calls over HTTP: tool_choice "required" and a named function, streamed or not.

One server (SmolLM2-135M, float32) for the module, driven with the official client, whose own
types parse `message.tool_calls` and accumulate the streamed `delta.tool_calls`.
"""

from __future__ import annotations

import contextlib
import json

import jsonschema
import openai
import pytest

from kvflow.entrypoints.openai.server import build_app

from .conftest import MODEL_NAME, serving

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
         {"type": "function", "function": {"name": "ping"}}]  # no parameters: an empty object
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "ping": {"type": "object", "properties": {},
                                                             "additionalProperties": False}}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _check_calls(calls, names=None) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    assert not names or [n for n, _ in out] == names
    return out


def _streamed(client, **kw) -> tuple[list[tuple[str, str, str]], str, str | None]:
    """(id, name, arguments) per streamed call, the streamed text, the finish reason."""
    calls: dict[int, list[str]] = {}
    text, reason = "", None
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=CHAT, stream=True, **kw):
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, ["", "", ""])
            if d.id:
                assert not entry[0], "a call's id comes once"
                entry[0] = d.id
            entry[1] += (d.function.name or "") if d.function else ""
            entry[2] += (d.function.arguments or "") if d.function else ""
        reason = chunk.choices[0].finish_reason or reason
    return [tuple(calls[i]) for i in sorted(calls)], text, reason


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(live_server, client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, tools=TOOLS, tool_choice=NAMED,
                                       max_tokens=64, temperature=0)
    choice = r.choices[0]
    # OpenAI ends a forced named call as "stop" ("tool_calls" is for a call the model chose).
    assert choice.finish_reason == "stop" and choice.message.content is None
    _check_calls(choice.message.tool_calls, ["get_weather"])
    # Streamed: the same arguments, piece by piece, under one id and name.
    calls, text, reason = _streamed(client, tools=TOOLS, tool_choice=NAMED, max_tokens=64, temperature=0)
    assert (text, reason) == ("", "stop") and len(calls) == 1
    assert calls[0][1:] == ("get_weather", choice.message.tool_calls[0].function.arguments)
    assert live_server.wait_pool_free()


@pytest.mark.parametrize("parallel", [None, False])
def test_required_calls_one_or_more_of_the_tools(live_server, client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    names = set()
    for seed in (1, 2, 3, 7):  # seeds on which the 135M model closes its array (others repeat a call to the end)
        r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, tools=TOOLS, tool_choice="required",
                                           max_tokens=96, temperature=1.0, seed=seed, **extra)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        calls = _check_calls(choice.message.tool_calls)
        assert len(calls) >= 1 and (parallel is None or len(calls) == 1)
        names |= {name for name, _ in calls}
    assert len(names) > 1, "every seed called the same function"
    streamed, text, reason = _streamed(client, tools=TOOLS, tool_choice="required", max_tokens=96, temperature=1.0,
                                       seed=7, **extra)
    assert (text, reason) == ("", "tool_calls")
    assert [(name, json.loads(args)) for _, name, args in streamed] == calls  # seed 7, as the last plain request
    assert live_server.wait_pool_free()


def test_named_arguments_cut_short_are_the_same_streamed_or_not(live_server, client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, tools=TOOLS, tool_choice=NAMED,
                                       max_tokens=5, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    partial = choice.message.tool_calls[0].function.arguments
    assert partial.startswith("{") and not partial.endswith("}")
    calls, text, reason = _streamed(client, tools=TOOLS, tool_choice=NAMED, max_tokens=5, temperature=0)
    assert (text, reason) == ("", "length") and [c[1:] for c in calls] == [("get_weather", partial)]
    assert live_server.wait_pool_free()


def test_required_calls_cut_short_come_back_as_their_text(live_server, client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, tools=TOOLS, tool_choice="required",
                                       max_tokens=4, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("[")
    calls, text, reason = _streamed(client, tools=TOOLS, tool_choice="required", max_tokens=4, temperature=0)
    assert (calls, text, reason) == ([], choice.message.content, "length")
    assert live_server.wait_pool_free()


def test_a_conversation_with_earlier_calls_and_their_results(live_server, client, http):
    first = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=64, temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages = CHAT + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    tokenized = http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert "18 degrees and sunny" in live_server.engine.tokenizer.decode(tokenized["tokens"])
    assert live_server.wait_pool_free()


@pytest.mark.parametrize(("body", "message"), [
    ({"tools": TOOLS}, "tool_choice 'auto'"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice 'auto'"),
    ({"tool_choice": "required"}, "needs `tools`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in `tools`"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "same name"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "not both"),
])
def test_refusals_name_tool_choice(live_server, http, body, message):
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] in ("tool_choice", "tools"), err
    assert live_server.wait_pool_free()


def test_tool_choice_none_generates_text(live_server, client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == plain.choices[0].message.content


@pytest.fixture(scope="module")
def auto_clients(live_server):
    """Apps over the module's engine started as `--enable-auto-tool-choice --tool-call-parser NAME`, by NAME."""
    with contextlib.ExitStack() as stack:
        clients = {}
        for name in ("hermes", "llama3_json", "mistral"):
            port = stack.enter_context(serving(build_app(live_server.engine, MODEL_NAME, live_server.api_key,
                                                         tool_call_parser=name)))
            clients[name] = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=live_server.api_key,
                                          max_retries=0, timeout=120)
        yield clients


# What each model family writes when it calls: a regex makes SmolLM2 write exactly that here.
CITY = '\\{"city": "Paris", "unit": "celsius"\\}'
HERMES = f'Let me look\\.\n<tool_call>\n\\{{"name": "get_weather", "arguments": {CITY}\\}}\n</tool_call>'
LLAMA3 = f'\\{{"name": "get_weather", "parameters": {CITY}\\}}'
MISTRAL = f'Let me look\\.\\[TOOL_CALLS\\]\\[\\{{"name": "get_weather", "arguments": {CITY}\\}}\\]'


@pytest.mark.parametrize(("parser", "regex", "content"), [
    ("hermes", HERMES, "Let me look."), ("llama3_json", LLAMA3, None), ("mistral", MISTRAL, "Let me look."),
    ("hermes", "Paris is sunny\\.", "Paris is sunny."), ("llama3_json", "Paris is sunny\\.", "Paris is sunny."),
    ("mistral", "Paris is sunny\\.", "Paris is sunny.")])
def test_auto_reads_the_calls_the_model_wrote(live_server, auto_clients, parser, regex, content):
    client, called = auto_clients[parser], regex.startswith(("Let", "\\{"))
    kw = dict(model=MODEL_NAME, messages=CHAT, tools=TOOLS, max_tokens=200, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    choice = client.chat.completions.create(**kw).choices[0]  # no tool_choice: "auto"
    calls, text, reason = _streamed(client, tool_choice="auto", **{k: v for k, v in kw.items() if k not in ("messages", "model")})
    if called:
        assert (choice.message.content, choice.finish_reason) == (content, "tool_calls")
        assert _check_calls(choice.message.tool_calls) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
        assert (text, reason) == (content or "", "tool_calls")
        assert [(name, json.loads(args)) for _, name, args in calls] == [("get_weather", {"city": "Paris",
                                                                                          "unit": "celsius"})]
    else:
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (content, None, "stop")
        assert (calls, text, reason) == ([], content, "stop")
    assert live_server.wait_pool_free()
