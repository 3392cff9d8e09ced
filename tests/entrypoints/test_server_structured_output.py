"""Structured output over HTTP: OpenAI's response_format and vLLM's structured_outputs, and their 400s.

One server (SmolLM2-135M, float32) for the module, driven with the official client and raw HTTP.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from .conftest import MODEL_NAME

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Describe a person as JSON: name, age, member or not."}]
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_chat_json_schema_validates_across_seeds(live_server, client):
    for seed in range(6):
        for temperature in (0.0, 1.0):
            r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=64, seed=seed,
                                               temperature=temperature, response_format=JSON_SCHEMA_FORMAT)
            choice = r.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert live_server.wait_pool_free()


def test_streamed_json_object_parses(live_server, client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=96, seed=1, temperature=0.7,
                                            response_format={"type": "json_object"}, stream=True)
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_completions_structured_outputs_regex_choice_grammar(live_server, client):
    prompt = "Q: What is the capital of France?\nA:"
    cases = [({"choice": ["Paris", "Lyon"]}, lambda t: t in ("Paris", "Lyon")),
             ({"regex": r"[A-Z][a-z]{1,10} [0-9]{2}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{1,10} [0-9]{2}", t)),
             ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
             ({"json": json.dumps(PERSON), "disable_any_whitespace": True},
              lambda t: jsonschema.validate(json.loads(t), PERSON) is None)]
    for so, check in cases:
        for seed in range(3):
            r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=64, temperature=1.0, seed=seed,
                                          extra_body={"structured_outputs": so})
            assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), (so, r.choices[0].text)
    assert live_server.wait_pool_free()


def test_structured_greedy_matches_offline_llm(live_server, client, offline_llm):
    from kvflow import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=PERSON)
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=64, temperature=0,
                                       response_format=JSON_SCHEMA_FORMAT)
    offline = offline_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=64, structured_outputs=so),
                               use_tqdm=False)[0].outputs[0].text
    assert r.choices[0].message.content == offline


def test_vllms_older_guided_fields_still_constrain(live_server, client):
    """Clients written for vLLM before `structured_outputs` send guided_json / _regex / _choice / _grammar."""
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=64, temperature=0,
                                          extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    for extra, check in (({"guided_regex": "[a-z]{2} fast"}, lambda t: re.fullmatch("[a-z]{2} fast", t)),
                         ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_grammar": 'root ::= "cat" | "dog"'}, lambda t: t in ("cat", "dog"))):
        text = client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=16, temperature=1.0, seed=4,
                                         extra_body=extra).choices[0].text
        assert check(text), (extra, text)
    assert live_server.wait_pool_free()


def test_response_format_text_is_unconstrained(live_server, client):
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0)
    text = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_compiling_does_not_hold_up_other_requests(live_server, http, monkeypatch):
    """A grammar that takes seconds to compile delays only its own request: others are served meanwhile."""
    backend = live_server.engine.engine.structured_output._get_backend()
    original, started, finished = backend.compile, threading.Event(), threading.Event()

    def slow_compile(params):
        started.set()
        time.sleep(4.0)
        try:
            return original(params)
        finally:
            finished.set()

    monkeypatch.setattr(backend, "compile", slow_compile)
    result = {}

    def constrained():
        result["r"] = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 8,
                                                         "structured_outputs": {"regex": "[a-z]{3} slow"}})

    worker = threading.Thread(target=constrained)
    worker.start()
    assert started.wait(30)
    plain = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True})
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 8
    assert not finished.is_set(), "the plain request waited for another request's grammar to compile"
    worker.join(60)
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"].endswith(" slow")
    assert live_server.wait_pool_free()


SCHEMA_NO_ROOT = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "schema": SCHEMA_NO_ROOT}}},
     "response_format", "response_format.json_schema.schema: invalid JSON schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format", "cannot enforce 'uniqueItems' at /"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs",
     "structured_outputs.regex: invalid regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs",
     "structured_outputs.grammar: invalid EBNF grammar"),
    ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ("/v1/completions", {"structured_outputs": {"json": "{oops"}}, "structured_outputs", "not valid JSON"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one kind"),
    ("/v1/completions", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ("/v1/completions", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
    ("/v1/completions", {"structured_outputs": {"regex": "a+"}, "min_tokens": 3}, "min_tokens", "min_tokens"),
    ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex", "guided_regex: invalid regex"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("/v1/completions", {"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "not both"),
    ("/v1/chat/completions", {"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format",
     "not both"),
]


@pytest.mark.parametrize(("path", "fields", "param", "message"), BAD, ids=[b[3][:40] for b in BAD])
def test_invalid_constraints_are_400s_naming_the_field(live_server, http, path, fields, param, message):
    body = {"model": MODEL_NAME, "max_tokens": 8, **fields}
    body.update({"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "Hi"})
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and message in err["message"], err
    assert live_server.wait_pool_free()
    ok = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200  # nothing else harmed
