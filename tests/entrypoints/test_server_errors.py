"""The server's error paths, end to end: bad requests in OpenAI's error shape, authentication,
unknown models, overload (503 with Retry-After), and a failing engine step, which fails only
the requests it held and leaves the server serving. One server (SmolLM2-135M, float32) serves
the module; every test leaves the engine idle.
"""

from __future__ import annotations

import json
import time

import openai
import pytest

from .conftest import CHAT, MODEL_NAME, PROMPT, httpx


def _assert_error(r, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


BAD = [
    ("/v1/completions", "{not json", None),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": 123}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [1] * 2100}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [10**7]}, "prompt"),  # refused by the engine thread
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"198": 150}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "bad_words": [""]}, "bad_words"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_requests(live_server, http, path, body, param):
    if isinstance(body, str):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    err = _assert_error(r, 400, param)
    assert err["type"] == "invalid_request_error"
    if body != "{not json" and body.get("max_tokens") == 5000:
        assert "2048" in err["message"] and "5000" in err["message"]


def test_logit_bias_and_bad_words_as_clients_send_them(live_server, client):
    """OpenAI's logit_bias (string token ids in JSON) and vLLM's bad_words through the official client."""
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert plain.choices[0].text.startswith(" Paris")
    paris = live_server.engine.engine.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    biased = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                       logit_bias={str(paris): -100})
    banned = client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0,
                                            messages=[{"role": "user", "content": "What is the capital of France?"}],
                                            extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in biased.choices[0].text and "Paris" not in banned.choices[0].message.content
    assert live_server.wait_pool_free()


def test_auth_model_and_overload_errors(live_server, client, http):
    anon = httpx.post(live_server.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "hi"}, timeout=10)
    _assert_error(anon, 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live_server.v1, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=2)
    live_server.engine.max_waiting = 0
    try:
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        _assert_error(r, 503)
        assert int(r.headers["Retry-After"]) >= 1
    finally:
        live_server.engine.max_waiting = 1024
    ok = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)  # still serving
    assert ok.choices[0].text is not None
    assert live_server.wait_pool_free()


def test_step_error_fails_request_and_keeps_serving(live_server, client):
    engine = live_server.engine.engine

    def broken_step():
        del engine.step  # fail exactly once: the class method is back for the next step
        raise RuntimeError("injected failure")

    errors_before = live_server.engine.num_step_errors  # the module's server: count this test's only
    engine.step = broken_step
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices[0].finish_reason
    assert live_server.engine.num_step_errors == errors_before + 1
    assert live_server.wait_pool_free()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_streams_error_event_has_the_code_a_whole_answer_gets(live_server, http, path):
    engine = live_server.engine.engine

    def broken_step():
        del engine.step
        raise RuntimeError("injected failure")

    engine.step = broken_step
    body = {"model": MODEL_NAME, "max_tokens": 4, "stream": True,
            **({"messages": CHAT} if "chat" in path else {"prompt": "hi"})}
    with http.stream("POST", path, json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("server_error", "engine_step_failed")  # a string, as unstreamed
    assert live_server.wait_pool_free()


def test_step_error_after_a_request_finished_still_answers_it(live_server, client):
    """A step finishes one request, then fails: that request's output was lost with the
    exception, and it is no longer running, yet it must get the error rather than hang."""
    import concurrent.futures

    engine = live_server.engine.engine
    real_step = type(engine).step

    def step_then_fail():
        outputs = real_step(engine)
        if any(o.finished for o in outputs):
            del engine.step
            raise RuntimeError("injected failure after the step's work")
        return outputs

    fast = client.with_options(timeout=60, max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long_request = pool.submit(fast.completions.create, model=MODEL_NAME, prompt="Tell me a story",
                                   max_tokens=300, extra_body={"ignore_eos": True})
        deadline = time.time() + 30
        while live_server.engine.get_stats().num_running == 0 and time.time() < deadline:
            time.sleep(0.01)
        engine.step = step_then_fail
        with pytest.raises(openai.InternalServerError):
            fast.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
        with pytest.raises(openai.InternalServerError):
            long_request.result()
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices[0].finish_reason
    assert live_server.wait_pool_free()
