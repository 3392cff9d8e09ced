"""The OpenAI-compatible server, end to end over loopback HTTP with the official client.

One server (SmolLM2-135M, float32) serves the whole module; every test leaves the engine
idle so the next one starts from a full pool. Unit tests of the wire models at the bottom
need no server. The error paths are in test_server_errors.py.
"""

from __future__ import annotations

import asyncio
import json

import openai
from pathlib import Path

import pytest

from kvflow.entrypoints.openai import protocol as p
from kvflow.entrypoints.openai.server import TextStreamer, build_app

from .conftest import CHAT, MODEL_NAME, PROMPT, check_cache_salt, httpx, serving



def sse_events(lines) -> list[dict | str]:
    """Parse an SSE body strictly: every event is `data: ...` followed by a blank line."""
    events, expect_blank = [], False
    for line in lines:
        if expect_blank:
            assert line == "", f"missing blank line after an event, got {line!r}"
            expect_blank = False
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
        expect_blank = True
    assert events and events[-1] == "[DONE]", "stream must end with data: [DONE]"
    return events


# ---- basic routes ---------------------------------------------------------------------------
def test_models_health_version(live_server, client, http):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_greedy_matches_offline_llm(live_server, client, offline_llm):
    from kvflow import SamplingParams

    server_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    chat_text = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16,
                                               temperature=0).choices[0].message.content
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stream=True) if c.choices)
    params = SamplingParams(temperature=0, max_tokens=16)
    assert server_text == offline_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    assert chat_text == offline_llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text
    assert streamed == server_text
    assert live_server.wait_pool_free()


# ---- formats --------------------------------------------------------------------------------
def test_chat_stream_format(live_server, http):
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks[1:] if c["choices"] and "content" in c["choices"][0]["delta"]]
    assert content and all(c["choices"][0]["finish_reason"] is None for c in content)
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["delta"] == {}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 6
    assert all("usage" not in c for c in chunks[:-1])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_count_so_far_on_every_chunk(live_server, http, path):
    body = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": PROMPT})
    with http.stream("POST", path, json=body) as r:
        chunks = sse_events(r.iter_lines())[:-1]
    usages = [c["usage"] for c in chunks]
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == 6 and len({u["prompt_tokens"] for u in usages}) == 1
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    text_chunks = [c for c in chunks if c["choices"] and (c["choices"][0].get("text") or
                                                         c["choices"][0].get("delta", {}).get("content"))]
    assert text_chunks and all(c["usage"]["completion_tokens"] >= 1 for c in text_chunks)
    assert live_server.wait_pool_free()


def test_usage_and_finish_reasons(live_server, client):
    tok = live_server.engine.tokenizer
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok(PROMPT).input_ids)
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    echo = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(PROMPT)
    ids = client.completions.create(model=MODEL_NAME, prompt=tok(PROMPT).input_ids, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.choices[0].text == r.choices[0].text


def test_truncate_prompt_tokens(live_server, http):
    """vLLM's truncate_prompt_tokens: the last k tokens run, the usage counts k, and a prompt longer
    than max_model_len is served once cut (and refused, naming the field, when k makes no sense)."""
    tok = live_server.engine.tokenizer
    ids = tok(PROMPT).input_ids
    body = {"model": MODEL_NAME, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    cut = http.post("/v1/completions", json={**body, "prompt": PROMPT, "truncate_prompt_tokens": 3}).json()
    direct = http.post("/v1/completions", json={**body, "prompt": ids[-3:]}).json()
    assert cut["choices"][0]["text"] == direct["choices"][0]["text"] and cut["usage"]["prompt_tokens"] == 3
    long = [7] * 2100  # max_model_len is 2048
    assert http.post("/v1/completions", json={**body, "prompt": long}).status_code == 400
    r = http.post("/v1/completions", json={**body, "prompt": long, "truncate_prompt_tokens": 64})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64
    chat = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "Hi there"}],
                                                   "truncate_prompt_tokens": 4})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 4
    bad = http.post("/v1/completions", json={**body, "prompt": PROMPT, "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
    assert live_server.wait_pool_free()


def test_cache_salt_keeps_tenants_apart(live_server, http):
    check_cache_salt(lambda route, body: http.post(route, json=body), "/v1/completions", {"model": MODEL_NAME})
    assert live_server.wait_pool_free()


def test_stop_string_never_leaks(live_server, client, http):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    tokens = base.logprobs.tokens
    # A stop string that straddles two tokens: its first half arrives one step before the rest.
    i = next(i for i in range(2, len(tokens) - 1) if len(tokens[i]) >= 3 and len(tokens[i + 1].strip()) >= 2)
    stop = tokens[i][-2:] + tokens[i + 1][:2]
    expected = base.text[: base.text.find(stop)]
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": [stop],
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r.iter_lines())
    pieces = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(pieces) == expected, (stop, pieces)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0)
    words = chat.choices[0].message.content.split()
    chat_stop = words[1][:3]
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0,
                                              stop=chat_stop, stream=True)
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chat_stop not in text and chat.choices[0].message.content.startswith(text)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible(live_server, client):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=1234)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b and a


def test_logprobs(live_server, client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3  # greedy: the chosen token is among the top 3
        assert logprob == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
    c = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for item in content:
        assert bytes(item.bytes) == item.token.encode() and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True)
    stream_tokens = [t.token for ch in streamed if ch.choices and ch.choices[0].logprobs
                     for t in ch.choices[0].logprobs.content]
    assert stream_tokens == [t.token for t in content]


# ---- concurrency, disconnects, liveness -----------------------------------------------------
def test_64_concurrent_streams(live_server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=f"Request {i}: the weather today is", max_tokens=8, temperature=0.7, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, finishes, ids, usage = "", [], set(), None
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.text
                finishes.append(choice.finish_reason)
        assert len(ids) == 1 and finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        return text, usage.completion_tokens

    async def run() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=live_server.v1, api_key=live_server.api_key,
                                      max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64 and all(n == 8 and text for text, n in results)
    assert live_server.wait_pool_free()
    live_server.engine.engine.check_integrity()


def test_stream_disconnect_frees_blocks(live_server):
    other = {"model": MODEL_NAME, "prompt": "List the days of the week:", "max_tokens": 20, "temperature": 0,
             "ignore_eos": True}
    long = {"model": MODEL_NAME, "prompt": "Write a very long story.", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}

    async def run() -> tuple[str, str]:
        async with httpx.AsyncClient(base_url=live_server.base_url, headers=live_server.headers, timeout=120) as c:
            alone = (await c.post("/v1/completions", json=other)).json()["choices"][0]["text"]
            async with c.stream("POST", "/v1/completions", json=long) as r:
                task = asyncio.create_task(c.post("/v1/completions", json=other))
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break  # leaving the block closes the connection mid-stream
            together = (await task).json()["choices"][0]["text"]
            return alone, together

    alone, together = asyncio.run(run())
    assert together == alone
    assert live_server.wait_pool_free(), live_server.engine.get_stats()


def test_nonstream_disconnect_aborts(live_server):
    body = {"model": MODEL_NAME, "prompt": "Write a very long story.", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=live_server.base_url, headers=live_server.headers, timeout=1.5) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json=body)
    assert live_server.wait_pool_free(), live_server.engine.get_stats()


def test_health_while_generating(live_server, http):
    body = {"model": MODEL_NAME, "prompt": "Write a long story.", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live_server.base_url, headers=live_server.headers, timeout=60) as streaming:
        with streaming.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # a token has been produced: generation is in flight
            assert http.get("/health").status_code == 200
            assert live_server.engine.get_stats().num_running == 1  # and it still runs
    assert live_server.wait_pool_free()


# ---- metrics --------------------------------------------------------------------------------
def _samples(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_metrics(live_server, http):
    names = ["time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
             "request_time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
             "request_queue_time_seconds_count", "num_requests_running", "num_requests_waiting",
             "kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
             "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total", "request_success_total",
             "prefill_tokens_total"]
    main = _samples(http.get("/metrics").text)
    assert all("kvflow:" + n in main for n in names), sorted(main)
    # A fresh app on the same engine counts only its own requests.
    app = build_app(live_server.engine, MODEL_NAME, None)
    with serving(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        for stream in (False, False, True):
            r = c.post("/v1/completions", json={**body, "stream": stream})
            assert r.status_code == 200
        assert live_server.wait_pool_free()
        m = _samples(c.get("/metrics").text)
    k = "kvflow:"
    assert m[k + "time_to_first_token_seconds_count"] == 3
    assert m[k + "e2e_request_latency_seconds_count"] == 3
    assert m[k + "request_queue_time_seconds_count"] == 3
    assert m[k + "request_time_per_output_token_seconds_count"] == 3
    assert m[k + "inter_token_latency_seconds_count"] == 3 * 3
    assert m[k + "request_success_total"] == 3
    assert m[k + "kv_cache_usage_perc"] == 0 and m[k + "num_requests_running"] == 0
    stats = live_server.engine.get_stats()
    assert m[k + "generation_tokens_total"] == stats.generation_tokens >= 12
    assert m[k + "prompt_tokens_total"] == stats.prompt_tokens
    assert m[k + "prefix_cache_hits_total"] <= m[k + "prefix_cache_queries_total"]
    assert 0 < m[k + "time_to_first_token_seconds_sum"] < 60


# ---- wire models and streaming helpers (no server) ------------------------------------------
def test_max_tokens_defaults():
    """Completions: 16 when absent (OpenAI's and vLLM's default), the rest of the context for an
    explicit null; chat: the rest of the context, as vLLM does."""
    req = p.CompletionRequest(prompt="hi", unknown_field=1)
    assert req.to_sampling_params(prompt_len=48, max_model_len=2048).max_tokens == 16
    assert req.to_sampling_params(prompt_len=2040, max_model_len=2048).max_tokens == 8  # what fits
    assert p.CompletionRequest(prompt="hi", max_tokens=None).to_sampling_params(48, 2048).max_tokens == 2000
    chat = p.ChatCompletionRequest(messages=[{"role": "user", "content": "a"}])
    assert chat.to_sampling_params(48, 2048).max_tokens == 2000
    model_default = {"max_tokens": 512}  # never past 16 when absent, as in vLLM; it caps an explicit null
    assert req.to_sampling_params(48, 2048, model_default).max_tokens == 16
    assert p.CompletionRequest(prompt="hi", max_tokens=None).to_sampling_params(48, 2048, model_default).max_tokens == 512
    with pytest.raises(p.InvalidRequestError, match="2048"):
        p.CompletionRequest(prompt="hi", max_tokens=2001).to_sampling_params(48, 2048)
    with pytest.raises(p.InvalidRequestError):
        p.CompletionRequest(prompt="hi").to_sampling_params(2048, 2048)
    chat = p.ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                                   max_completion_tokens=7, max_tokens=9, logprobs=True, top_logprobs=3)
    params = chat.to_sampling_params(10, 2048)
    assert params.max_tokens == 7 and params.logprobs == 3
    assert chat.messages[0].to_template_dict() == {"role": "user", "content": "a"}


def test_text_streamer_holds_back_stop_prefixes():
    s = TextStreamer(["END"])
    assert s.delta("Hello E", finished=False) == "Hello "
    assert s.delta("Hello EN", finished=False) == ""
    assert s.delta("Hello ENx", finished=False) == "ENx"
    assert s.delta("Hello ENxE", finished=True) == "E"


# ---- the README's example, as a newcomer runs it ----------------------------------------------
def readme_curl_body() -> dict:
    """The JSON body of the README's curl example, read from the README itself."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    curl = next(block for block in readme.split("```") if "curl" in block and "/v1/chat/completions" in block)
    return json.loads(curl.split("-d '", 1)[1].split("'", 1)[0])


def test_readme_curl_answers_paris(live_server, http):
    """The README's request, which sets no sampling fields: the model's defaults (temperature 0.2, top_p 0.9)
    apply, and under a fixed seed (the only field added) the answer names Paris."""
    body = readme_curl_body()
    assert not {"temperature", "top_p", "top_k", "seed"} & set(body)  # the README relies on the defaults
    card = http.get(f"/v1/models/{MODEL_NAME}").json()
    assert card["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9}
    r = http.post("/v1/chat/completions", json={**body, "model": MODEL_NAME, "seed": 0})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    assert live_server.wait_pool_free()
