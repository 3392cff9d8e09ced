"""The server with speculative decoding on: same greedy text as plain `LLM`, streaming intact,
acceptance visible in /metrics, the pool whole afterwards."""

from __future__ import annotations

import json

import pytest

from kvflow import SamplingParams
from kvflow.config import EngineConfig
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.openai.server import build_app
from tests.entrypoints.conftest import ENGINE_KWARGS, LiveServer, httpx, serving

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
# The answer quotes the prompt, so drafts are proposed and accepted.
PROMPT = "Repeat this line exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over"


@pytest.fixture(scope="module")
def spec_server():
    engine = AsyncEngine.from_config(EngineConfig(**ENGINE_KWARGS, speculative_config=SPEC), max_waiting=64)
    try:
        with serving(build_app(engine, "smollm2", None)) as port:
            yield LiveServer(f"http://127.0.0.1:{port}", "", "smollm2", engine)
    finally:
        engine.shutdown()


def _metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_greedy_text_and_stream_match_plain_decoding(spec_server, offline_llm):
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    want = offline_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    with httpx.Client(base_url=spec_server.base_url, timeout=120) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        assert r.json()["usage"]["completion_tokens"] == len(want.token_ids)
        pieces = []
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(pieces) == want.text
        assert spec_server.wait_pool_free()
        m = _metrics(c.get("/metrics").text)
    k = 'kvflow:spec_decode_num_{}_total{{model_name="smollm2"}}'
    assert m[k.format("draft_tokens")] >= m[k.format("accepted_tokens")] > 0
    assert m[k.format("drafts")] > 0
    assert 0 < m['kvflow:spec_decode_acceptance_rate{model_name="smollm2"}'] <= 1
    assert m['kvflow:spec_decode_mean_accepted_length{model_name="smollm2"}'] > 1
    assert m['kvflow:spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2",position="0"}'] > 0
