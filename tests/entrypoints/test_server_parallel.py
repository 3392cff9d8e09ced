"""`n`, lists of prompts and `echo` with `logprobs` over HTTP, shaped as OpenAI and vLLM answer.

Choices are indexed prompt-major (index = prompt_index * n + sample_index), streamed chunks name
the choice they extend, usage counts each prompt once and every sample's completion.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from kvflow import SamplingParams

from .conftest import MODEL_NAME, httpx

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name three colors."}]


def _events(response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def _prompt_len(live_server, prompt: str) -> int:
    return len(live_server.engine.tokenizer(prompt).input_ids)


def test_list_of_prompts_times_n_greedy(live_server, client, offline_llm):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, n=3, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == list(range(6))
    offline = offline_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for i, out in enumerate(offline):
        for j in range(3):
            assert r.choices[i * 3 + j].text == out.outputs[0].text
    assert r.usage.prompt_tokens == sum(_prompt_len(live_server, p) for p in PROMPTS)  # once per prompt
    assert r.usage.completion_tokens == 3 * sum(len(o.outputs[0].token_ids) for o in offline)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ids = client.completions.create(model=MODEL_NAME, prompt=[[504, 3458], [1, 2, 3]], max_tokens=2, temperature=0)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5
    assert live_server.wait_pool_free()


def test_seeded_stream_matches_nonstream_by_index(live_server, http):
    body = {"model": MODEL_NAME, "prompt": PROMPTS, "n": 2, "max_tokens": 12, "temperature": 1.0, "seed": 5}
    whole = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in whole["choices"]]
    assert len(set(texts)) > 1  # independent draws
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=stream) as r:
        events = _events(r)
    pieces: dict[int, str] = {i: "" for i in range(4)}
    finishes: dict[int, list] = {i: [] for i in range(4)}
    for e in events[:-1]:
        assert len(e["choices"]) == 1 and e["id"] == events[0]["id"]
        c = e["choices"][0]
        pieces[c["index"]] += c["text"]
        if c["finish_reason"] is not None:
            finishes[c["index"]].append(c["finish_reason"])
    assert [pieces[i] for i in range(4)] == texts
    assert all(len(f) == 1 for f in finishes.values())
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert live_server.wait_pool_free()


def test_chat_n(live_server, http):
    body = {"model": MODEL_NAME, "messages": CHAT, "n": 3, "max_tokens": 10, "temperature": 1.0, "seed": 2,
            "logprobs": True, "top_logprobs": 1}
    whole = http.post("/v1/chat/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert all(len(c["logprobs"]["content"]) > 0 for c in whole["choices"])
    completion = sum(len(c["logprobs"]["content"]) for c in whole["choices"])
    assert whole["usage"]["completion_tokens"] == completion
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = _events(r)
    roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role")]
    assert roles == [0, 1, 2]
    content = {i: "" for i in range(3)}
    for e in events:
        c = e["choices"][0]
        content[c["index"]] += c["delta"].get("content") or ""
    assert [content[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]) == [0, 1, 2]
    assert live_server.wait_pool_free()


def test_echo_with_logprobs(live_server, http, offline_llm):
    prompt = PROMPTS[0]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2,
            "n": 2}
    r = http.post("/v1/completions", json=body).json()
    offline = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2,
                                                          logprobs=2), use_tqdm=False)[0]
    plen = len(offline.prompt_token_ids)
    for choice in r["choices"]:
        assert choice["text"] == prompt + offline.outputs[0].text
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == plen + 3
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for pos in range(1, plen):
            tid = offline.prompt_token_ids[pos]
            assert lp["token_logprobs"][pos] == pytest.approx(offline.prompt_logprobs[pos][tid].logprob, abs=1e-6)
            top = lp["top_logprobs"][pos]  # the top 2 and the prompt's own token: up to logprobs + 1 (OpenAI)
            assert 2 <= len(top) <= 3 and top[lp["tokens"][pos]] == lp["token_logprobs"][pos]
        assert lp["token_logprobs"][plen:] == pytest.approx(
            [e[t].logprob for t, e in zip(offline.outputs[0].token_ids, offline.outputs[0].logprobs)], abs=1e-6)
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"][0] == 0 and lp["text_offset"][plen] == len(prompt)
        assert lp["text_offset"] == sorted(lp["text_offset"])
        assert choice.get("prompt_logprobs") is None  # not asked for: only the echo carries them
    # Streamed: each choice's first chunk is the echo with the prompt's logprobs.
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = _events(s)
    first = {}
    for e in events:
        first.setdefault(e["choices"][0]["index"], e["choices"][0])
    for index in (0, 1):
        assert first[index]["text"] == prompt
        assert first[index]["logprobs"]["token_logprobs"][0] is None
        assert len(first[index]["logprobs"]["tokens"]) == plen
    assert live_server.wait_pool_free()


def test_prefill_counter_n8_computes_the_prompt_once(live_server, http):
    """Issue 17's target: n=8 on one 512-token prompt computes the prompt once (+ < a block per sample)."""
    tok = live_server.engine.tokenizer
    ids = (tok("The history of the city is long and full of surprising turns. ").input_ids * 64)[:512]

    def counters() -> dict[str, float]:
        text = http.get("/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r'^kvflow:(\w+_total)\{[^}]*\} (\S+)$', text, re.M)}

    before = counters()
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "n": 8, "max_tokens": 4,
                                           "temperature": 1.0, "seed": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    assert live_server.wait_pool_free()
    after = counters()
    prefill = after["prefill_tokens_total"] - before["prefill_tokens_total"]
    block = live_server.engine.engine.config.block_size
    assert 512 <= prefill <= 512 + 8 * block, prefill
    assert prefill == 512 + 7 * block  # 512 = 32 whole blocks: each sample recomputes the last one
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 512
    assert r.json()["usage"]["prompt_tokens"] == 512


BAD = [
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 1000000}, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[5, 6], [10**7]]}, "prompt"),  # the second prompt is refused: the first is withdrawn
]


@pytest.mark.parametrize("body,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_parallel_requests(live_server, http, body, param):
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert live_server.wait_pool_free()


def test_chat_n_bounds(live_server, http):
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "n": 129})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "128" in r.json()["error"]["message"]


def test_stream_disconnect_with_n_frees_every_sample(live_server):
    body = {"model": MODEL_NAME, "prompt": PROMPTS, "n": 3, "max_tokens": 1000, "temperature": 1.0,
            "ignore_eos": True, "stream": True}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=live_server.base_url, headers=live_server.headers, timeout=120) as c:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 12:
                        break

    asyncio.run(run())
    assert live_server.wait_pool_free(), live_server.engine.get_stats()


# ---- choices.py helpers (no server) ---------------------------------------------------------
def test_prompt_list_and_best_of():
    from kvflow.entrypoints.openai import choices as c
    from kvflow.entrypoints.openai import protocol as p

    assert c.prompt_list("hi") == ["hi"] and c.prompt_list([1, 2]) == [[1, 2]]
    assert c.prompt_list(["a", "b"]) == ["a", "b"] and c.prompt_list([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([], [[1], []]):
        with pytest.raises(p.InvalidRequestError):
            c.prompt_list(bad)
    c.check_best_of(None, 3)
    c.check_best_of(3, 3)
    with pytest.raises(p.InvalidRequestError, match=r"best_of must be greater than or equal to n \(3\), got 2"):
        c.check_best_of(2, 3)


def test_merged_interleaves_and_closes_every_source():
    from kvflow.entrypoints.openai import choices as c

    closed: list[int] = []

    async def source(i: int, delays: list[float]):
        try:
            for k, d in enumerate(delays):
                await asyncio.sleep(d)
                yield f"{i}.{k}"
        finally:
            closed.append(i)

    async def run(limit: int | None) -> list[tuple[int, str]]:
        got = []
        # Items 0.3 s apart or more, so that a stalled CI machine keeps their order.
        async with c.merging([source(0, [0.0, 0.75, 0.75]), source(1, [0.3, 0.0, 2.4])]) as items:
            async for item in items:
                got.append(item)
                if limit is not None and len(got) == limit:
                    break
        return got

    assert asyncio.run(run(None)) == [(0, "0.0"), (1, "1.0"), (1, "1.1"), (0, "0.1"), (0, "0.2"), (1, "1.2")]
    assert sorted(closed) == [0, 1]
    closed.clear()
    assert len(asyncio.run(run(2))) == 2
    assert sorted(closed) == [0, 1]  # leaving early closes the sources still running (their aborts)


def test_merged_one_source_passes_items_through_and_closes_it():
    from kvflow.entrypoints.openai import choices as c

    closed: list[int] = []

    async def source():
        try:
            for k in range(3):
                await asyncio.sleep(0)
                yield k
        finally:
            closed.append(0)

    async def run(limit: int | None) -> list[tuple[int, int]]:
        got = []
        async with c.merging([source()]) as items:
            async for item in items:
                got.append(item)
                if limit is not None and len(got) == limit:
                    break
        # checked here, not after asyncio.run: its shutdown would close a forgotten generator itself
        assert closed == [0]
        return got

    assert asyncio.run(run(None)) == [(0, 0), (0, 1), (0, 2)]
    closed.clear()
    assert asyncio.run(run(1)) == [(0, 0)]  # a client that leaves mid-stream closes the source: its request is aborted
