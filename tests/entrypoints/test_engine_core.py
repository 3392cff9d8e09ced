"""The split server: the API server over an engine core in its own process (entrypoints/core/).

One core process (SmolLM2-135M, float32) serves the module through the real app on a loopback
port; the last test kills it. Greedy text must equal the in-process `LLM`'s, streaming must equal
non-streaming, aborts must free blocks in the other process, and a dead core must give OpenAI-
shaped errors and an unhealthy /health without hanging anyone.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from kvflow.config import EngineConfig
from kvflow.entrypoints.core import wire
from kvflow.entrypoints.core.client import EngineCoreClient
from kvflow.entrypoints.openai.server import build_app
from kvflow.sampling.params import SamplingParams

from .conftest import ENGINE_KWARGS, MODEL_NAME, check_cache_salt, httpx, serving, wait_engine_idle

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def split_server():
    engine = EngineCoreClient(EngineConfig(**ENGINE_KWARGS), max_waiting=64)
    try:
        with serving(build_app(engine, MODEL_NAME)) as port, \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            yield engine, http
    finally:
        engine.shutdown()


def completion(http, prompt=PROMPT, **kw) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(http, body: dict) -> list:
    with http.stream("POST", "/v1/completions", json={"model": MODEL_NAME, "stream": True, **body}) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_the_stopping_token_is_not_text_as_in_process(split_server, offline_llm):
    """The API process assembles the text from the core's ids with the engine's rule: the EOS that
    ends the sequence adds none, special tokens kept or not, unless include_stop_str_in_output."""
    _, http = split_server
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    for extra in ({}, {"include_stop_str_in_output": True}):
        ref = offline_llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False, **extra),
                               use_tqdm=False)[0].outputs[0]
        r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": chat, "temperature": 0,
                                                    "max_tokens": 64, "skip_special_tokens": False, **extra})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == ref.finish_reason == "stop"
        assert choice["message"]["content"] == ref.text and ref.text.endswith("<|im_end|>") == bool(extra)


def test_cache_salt_crosses_to_the_core(split_server):
    _, http = split_server
    check_cache_salt(lambda route, body: http.post(route, json=body), "/v1/chat/completions", {"model": MODEL_NAME})


def test_greedy_text_stream_and_usage_match_in_process(split_server, offline_llm):
    engine, http = split_server
    ref = offline_llm.generate([PROMPT, "def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=24),
                               use_tqdm=False)
    for prompt, out in zip([PROMPT, "def fibonacci(n):"], ref):
        body = completion(http, prompt, max_tokens=24)
        assert body["choices"][0]["text"] == out.outputs[0].text
        assert body["usage"]["completion_tokens"] == len(out.outputs[0].token_ids)
        events = stream_events(http, {"prompt": prompt, "max_tokens": 24, "temperature": 0})
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == out.outputs[0].text
    assert wait_engine_idle(engine, 30), engine.get_stats()


def test_stop_strings_logprobs_and_n(split_server, offline_llm):
    engine, http = split_server
    params = SamplingParams(temperature=0, max_tokens=24, stop=["\n\n"], logprobs=2)
    ref = offline_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    body = completion(http, max_tokens=24, stop=["\n\n"], logprobs=2)["choices"][0]
    assert body["text"] == ref.text and body["finish_reason"] == "stop"
    assert len(body["logprobs"]["tokens"]) == len(ref.token_ids)
    streamed = stream_events(http, {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": ["\n\n"]})
    assert "".join(json.loads(e)["choices"][0]["text"] for e in streamed[:-1]) == ref.text
    two = completion(http, max_tokens=8, n=2, temperature=0.8, seed=3)["choices"]
    assert [c["index"] for c in two] == [0, 1]


def test_chat_metrics_dashboard_and_errors(split_server):
    engine, http = split_server
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 8, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    metrics = http.get("/metrics").text
    assert "kvflow:prompt_tokens_total" in metrics or "prompt_tokens" in metrics
    assert engine.get_stats().generation_tokens > 0  # the core's counters reach this process
    frame = http.get("/dashboard/events", params={"frames": 1, "interval": 0.1})  # a pool snapshot via call()
    assert frame.status_code == 200 and "blocks" in frame.text
    bad = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [10**7], "max_tokens": 2})
    assert bad.status_code == 400 and "token ids" in bad.json()["error"]["message"]  # refused in the core
    schema = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2,
                                                "response_format": {"type": "json_schema", "json_schema": {
                                                    "name": "s", "schema": {"type": "nonsense"}}}})
    assert schema.status_code == 400, schema.text
    # Refused in the core, or before the wire: every one a 400 naming its field, nothing left in the tables.
    for body, param in (({"prompt": "x", "logit_bias": {"60000": 1}}, "logit_bias"),
                        ({"prompt": "x", "allowed_token_ids": [10**30]}, "allowed_token_ids"),
                        ({"prompt": [2**70]}, "prompt"),
                        ({"prompt": "x", "bad_words": ["Paris"], "max_tokens": 2}, None)):
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "max_tokens": 2, **body})
        if param is None:
            assert r.status_code == 200, r.text
            continue
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not engine._streams and not engine._adds


def test_disconnect_aborts_in_the_core(split_server):
    engine, http = split_server
    body = {"model": MODEL_NAME, "prompt": "Write a long story.", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    assert wait_engine_idle(engine, 30), engine.get_stats()


def test_stop_string_ends_the_request_in_the_core(split_server, offline_llm):
    """The API process finds the stop string and aborts the request in the core: same text as
    in-process, and the core stops generating at once (its blocks back in the pool)."""
    engine, http = split_server
    free = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 3:][:2]
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        ref = offline_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        before = engine.get_stats().generation_tokens
        body = completion(http, max_tokens=1000, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        choice = body["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (ref.text, "stop")
        assert body["usage"]["completion_tokens"] == len(ref.token_ids)
        streamed = stream_events(http, {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                                        "stop": [stop], "include_stop_str_in_output": include})
        assert "".join(json.loads(e)["choices"][0]["text"] for e in streamed[:-1]) == ref.text
        assert wait_engine_idle(engine, 30), engine.get_stats()
        # Two requests of ~len(ref) tokens each, plus the steps before the aborts landed (a loaded
        # machine may run a few hundred): not 2 x 1000.
        assert engine.get_stats().generation_tokens - before < 2 * len(ref.token_ids) + 400
    # n > 1: a stop string ends each sample on its own (abort_sample in the core while the others go on).
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=24, stop=["e"])
    ref = offline_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    got = completion(http, n=3, temperature=0.8, seed=5, max_tokens=24, stop=["e"])["choices"]
    assert [(c["text"], c["finish_reason"]) for c in got] == [(r.text, r.finish_reason) for r in ref]
    assert wait_engine_idle(engine, 30), engine.get_stats()


def test_wire_errors_and_params_cross_whole():
    # Refusals keep their class across the wire, so the server's handlers give the same status.
    from kvflow.entrypoints.async_engine import EngineOverloadedError
    from kvflow.structured_output.backend import StructuredOutputError

    overloaded = wire.decode_error(*wire.unpack(wire.pack(wire.encode_error(EngineOverloadedError(5, 4)))))
    assert isinstance(overloaded, EngineOverloadedError) and overloaded.max_waiting == 4 and "max_waiting=4" in str(overloaded)
    so = wire.decode_error(*wire.encode_error(StructuredOutputError("bad", "regex")))
    assert isinstance(so, StructuredOutputError) and so.field == "regex"
    params = SamplingParams(temperature=0.5, stop=["a"], seed=2**64 - 1, max_tokens=3, logit_bias={"7": -1.5},
                            allowed_token_ids=[7, 9], bad_words=["no"])
    back = wire.decode_params(wire.unpack(wire.pack((wire.encode_params(params),)))[0])
    assert (back.stop, back.seed, back.temperature) == (["a"], 2**64 - 1, 0.5)
    assert (back.logit_bias, back.allowed_token_ids, back.bad_words) == ({7: -1.5}, [7, 9], ["no"])


def test_killed_core_fails_requests_and_health(split_server):
    """Last in the module: SIGKILL the core mid-stream."""
    engine, http = split_server
    body = {"model": MODEL_NAME, "prompt": "Write a long story.", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    killer = threading.Timer(1.0, os.kill, (engine.core_pid, signal.SIGKILL))
    started = time.monotonic()
    killer.start()
    events = stream_events(http, body)
    assert time.monotonic() - started < 30
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    # the stream's error event has the code a request answered whole gets (an int 500 before)
    assert error["type"] == "server_error" and "died" in error["message"] and error["code"] == "engine_dead"
    health = http.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == "engine_dead"
