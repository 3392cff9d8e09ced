"""The server's `prompt_logprobs` field (vLLM's extension), as lm-evaluation-harness sends it.

Completions carry them on the choice, chat completions on the response, as vLLM's server
does: a list with None first, then {token id: {logprob, rank, decoded_token}} per prompt token.
"""

from __future__ import annotations

import math

import pytest

from kvflow import SamplingParams
from kvflow.entrypoints.openai import protocol as p
from kvflow.entrypoints.openai.logprobs import prompt_logprobs
from kvflow.outputs import Logprob

from .conftest import MODEL_NAME

PROMPT = "The quick brown fox jumps over the lazy dog because"
CHAT = [{"role": "user", "content": "Name three colors."}]


def check_shape(entries: list, prompt_ids: list[int], k: int, decode) -> None:
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for i, entry in enumerate(entries[1:], 1):
        assert str(prompt_ids[i]) in entry and len(entry) in (k, k + 1)
        for tid, item in entry.items():
            assert set(item) == {"logprob", "rank", "decoded_token"}
            assert item["logprob"] <= 0 and isinstance(item["rank"], int) and item["rank"] >= 1
            assert item["decoded_token"] == decode(int(tid))
        tops = sorted((v for t, v in entry.items() if t != str(prompt_ids[i]) or len(entry) == k),
                      key=lambda v: v["rank"])
        assert [v["rank"] for v in tops] == list(range(1, k + 1))


def test_completion_prompt_logprobs_match_offline(live_server, http, offline_llm):
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2,
                                           "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    entries = body["choices"][0]["prompt_logprobs"]
    offline = offline_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                                   use_tqdm=False)[0]
    ids = offline.prompt_token_ids
    assert body["usage"]["prompt_tokens"] == len(ids)
    tok = offline_llm.engine.tokenizer
    check_shape(entries, ids, 2, lambda t: tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False))
    for i in range(1, len(ids)):
        for tid, lp in offline.prompt_logprobs[i].items():  # vLLM's Logprob records offline, their JSON online
            assert entries[i][str(tid)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert entries[i][str(tid)]["rank"] == lp.rank
            assert entries[i][str(tid)]["decoded_token"] == lp.decoded_token
    assert live_server.wait_pool_free()


def test_chat_prompt_logprobs_on_the_response(live_server, client):
    """Through the official client, as an extra body field; chat puts them on the response."""
    c = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    entries = c.model_extra["prompt_logprobs"]
    assert len(entries) == c.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 and math.isfinite(next(iter(e.values()))["logprob"]) for e in entries[1:])
    assert "prompt_logprobs" not in (c.choices[0].model_extra or {})
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.model_extra.get("prompt_logprobs") is None
    cmpl = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0)
    assert cmpl.choices[0].model_extra.get("prompt_logprobs") is None
    assert live_server.wait_pool_free()


def test_prompt_logprobs_refusals(live_server, http):
    base = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    r = http.post("/v1/completions", json={**base, "prompt_logprobs": 21})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and err["message"].startswith("prompt_logprobs must be in [0, 20]")
    r = http.post("/v1/completions", json={**base, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "`prompt_logprobs` are not available when `stream=True`.",
                                 "type": "invalid_request_error", "param": "prompt_logprobs", "code": None}
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "prompt_logprobs": 3,
                                                "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = http.post("/v1/completions", json={**base, "prompt_logprobs": 0, "stream": True})  # vLLM lets 0 through
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert live_server.wait_pool_free()


# ---- wire models (no server) --------------------------------------------------------------------
def test_to_sampling_params_passes_prompt_logprobs():
    assert p.CompletionRequest(prompt="hi", prompt_logprobs=3).to_sampling_params(4, 64).prompt_logprobs == 3
    assert p.CompletionRequest(prompt="hi").to_sampling_params(4, 64).prompt_logprobs is None
    # 0 in a stream has nowhere to go: the engine is not asked to compute it
    streamed = p.CompletionRequest(prompt="hi", prompt_logprobs=0, stream=True)
    assert streamed.to_sampling_params(4, 64).prompt_logprobs is None
    chat = p.ChatCompletionRequest(messages=CHAT, prompt_logprobs=1)
    assert chat.to_sampling_params(4, 64).prompt_logprobs == 1


def test_prompt_logprobs_payload_ranks_and_clamp():
    entries = [None, {7: Logprob(-3.0, 12), 1: Logprob(-0.5, 1), 2: Logprob(-1.0, 2)},
               {9: Logprob(float("-inf"), 2), 5: Logprob(-0.1, 1)}]
    out = prompt_logprobs(entries, lambda t: f"<{t}>")
    assert out[0] is None
    # the engine's ranks pass as they are (the prompt token 7 lies past the top-2); names come from `decode`
    assert {t: (v.logprob, v.rank, v.decoded_token) for t, v in out[1].items()} == {
        "7": (-3.0, 12, "<7>"), "1": (-0.5, 1, "<1>"), "2": (-1.0, 2, "<2>")}
    assert out[2]["9"].logprob == -9999.0 and out[2]["9"].rank == 2 and out[2]["5"].rank == 1
    assert list(out[1]) == ["7", "1", "2"]  # the engine's order: the prompt token first, as vLLM
