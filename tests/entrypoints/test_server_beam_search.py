"""`use_beam_search` through the server, in-process and split: the beams `LLM.beam_search` finds,
as `n` choices per prompt; what beam search cannot honour is refused by name."""

from __future__ import annotations

import pytest

from kvflow import LLM, BeamSearchParams
from kvflow.config import EngineConfig
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.core.client import EngineCoreClient
from kvflow.entrypoints.openai.server import build_app
from tests.entrypoints.conftest import ENGINE_KWARGS, httpx, serving, wait_engine_idle

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MESSAGES = [{"role": "user", "content": "Name a colour."}]
PARAMS = BeamSearchParams(beam_width=3, max_tokens=6)


@pytest.fixture(scope="module", params=["in-process", "split"])
def server(request):
    config = EngineConfig(**ENGINE_KWARGS)
    engine = AsyncEngine.from_config(config) if request.param == "in-process" else EngineCoreClient(config)
    try:
        with serving(build_app(engine, "smol")) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                                                     timeout=120) as http:
            yield http, engine
    finally:
        engine.shutdown()


def test_completions_return_the_beams(server, smollm2_fp32: LLM):
    http, engine = server
    offline = smollm2_fp32.beam_search(PROMPTS, PARAMS)
    r = http.post("/v1/completions", json={"prompt": PROMPTS, "use_beam_search": True, "n": 3, "max_tokens": 6})
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == list(range(6))
    assert [(c["text"], c["finish_reason"]) for c in data["choices"]] == [
        (seq.text, seq.finish_reason) for out in offline for seq in out.sequences]
    assert data["usage"]["completion_tokens"] == sum(len(s.logprobs) for out in offline for s in out.sequences)
    assert wait_engine_idle(engine, 10)


def test_chat_returns_the_beams(server, smollm2_fp32: LLM):
    http, engine = server
    prompt = smollm2_fp32.apply_chat_template(MESSAGES)
    offline = smollm2_fp32.beam_search([prompt], PARAMS)[0]
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "use_beam_search": True, "n": 3,
                                                "max_tokens": 6})
    assert r.status_code == 200, r.text
    assert [(c["message"]["content"], c["finish_reason"]) for c in r.json()["choices"]] == [
        (seq.text, seq.finish_reason) for seq in offline.sequences]
    assert wait_engine_idle(engine, 10)


@pytest.mark.parametrize("extra, field", [
    ({"stream": True}, "stream"),
    ({"logprobs": 0}, "logprobs"),
    ({"stop": ["x"]}, "stop"),
    ({"echo": True}, "echo"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ({"n": 11}, "n"),
    ({"length_penalty": "x"}, "length_penalty"),
    ({"stop_token_ids": [13]}, "stop_token_ids"),
    ({"logit_bias": {"13": 5}}, "logit_bias"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"top_p": 0.5}, "top_p"),
    ({"seed": 3, "temperature": 0.7}, "seed"),
])
def test_refusals(server, extra, field):
    """Refused by name, never ignored; the no-op values of these fields are accepted."""
    http, engine = server
    body = {"prompt": PROMPTS[0], "use_beam_search": True, "n": 2, "max_tokens": 4, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] and (error["param"] == field or field == "length_penalty")
    assert wait_engine_idle(engine, 10)


def test_neutral_values_are_accepted(server):
    http, engine = server
    body = {"prompt": PROMPTS[0], "use_beam_search": True, "n": 2, "max_tokens": 3, "top_p": 1, "top_k": -1,
            "repetition_penalty": 1.0, "stop_token_ids": [], "seed": 5}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert wait_engine_idle(engine, 10)
