"""Sampling precedence, request > model defaults (generation_config) > engine defaults, in LLM and the server.

A tiny random Llama whose generation_config.json sets temperature 0.5, top_k 7 and
max_new_tokens 3 stands in for a model with defaults; what reaches the engine is read
from a spy on its add_request, and max_tokens is also visible in the output's length.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.openai.server import build_app

from .conftest import httpx, serving

MODEL_DEFAULTS = {"temperature": 0.5, "top_k": 7, "max_new_tokens": 3}
PROMPT = [11, 12, 13, 14, 15]
TINY_ENGINE = dict(dtype="float32", kv_cache_memory=8 << 20, max_model_len=256, num_threads=1)


@pytest.fixture(scope="module")
def tiny_with_defaults(tiny_models, tmp_path_factory) -> str:
    """A copy of the tiny Llama (the shared one stays untouched) with sampling defaults of its own."""
    source, _ = tiny_models("llama")
    folder = tmp_path_factory.mktemp("tiny-gen-config") / "model"
    shutil.copytree(source, folder)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **MODEL_DEFAULTS}))
    return str(folder)


def spy_params(engine, monkeypatch) -> list[SamplingParams]:
    """Record the SamplingParams of every request the (sync or async) engine receives."""
    seen: list[SamplingParams] = []
    real = engine.add_request

    def add_request(request_id, prompt, params=None, *args, **kwargs):
        seen.append(params)
        return real(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_request)
    return seen


# ---- LLM ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(tiny_with_defaults) -> LLM:
    return LLM(tiny_with_defaults, **TINY_ENGINE)


def test_llm_fills_unset_fields_from_the_model(tiny_llm, monkeypatch):
    seen = spy_params(tiny_llm.engine, monkeypatch)
    default = tiny_llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.max_tokens, default.top_p) == (0.5, 7, 3, 1.0)
    out = tiny_llm.generate({"prompt_token_ids": PROMPT}, use_tqdm=False)[0]  # no params: the model's
    assert (seen[-1].temperature, seen[-1].top_k, seen[-1].max_tokens) == (0.5, 7, 3)
    assert len(out.outputs[0].token_ids) <= 3
    # A SamplingParams passed explicitly: the fields it names win, the others are the model's.
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    out = tiny_llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert (seen[-1].temperature, seen[-1].top_k, seen[-1].max_tokens) == (1.0, 7, 6)
    assert len(out.outputs[0].token_ids) == 6
    assert params.top_k == 0 and params.explicit_fields == {"temperature", "max_tokens", "ignore_eos"}  # not mutated
    # Even SamplingParams() passed explicitly leaves every field unset.
    tiny_llm.generate({"prompt_token_ids": PROMPT}, [SamplingParams(ignore_eos=True)], use_tqdm=False)
    assert (seen[-1].temperature, seen[-1].top_k, seen[-1].max_tokens) == (0.5, 7, 3)


def test_llm_generation_config_vllm_ignores_the_model(tiny_with_defaults):
    llm = LLM(tiny_with_defaults, generation_config="vllm", **TINY_ENGINE)
    assert llm.engine.sampling_defaults.values == {}
    assert llm.get_default_sampling_params() == SamplingParams()
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16  # vLLM's SamplingParams default, not the model's 3


def test_bundled_model_defaults_in_llm(smollm2_fp32):
    params = smollm2_fp32.get_default_sampling_params()
    assert (params.temperature, params.top_p) == (0.2, 0.9)


# ---- the server -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_servers(tiny_with_defaults):
    """Two servers on the same model: generation_config auto and vllm."""
    with contextlib.ExitStack() as stack:  # unwinds each server, then its engine
        servers = {}
        for mode in ("auto", "vllm"):
            engine = AsyncEngine.from_config(EngineConfig(model=tiny_with_defaults, generation_config=mode,
                                                          **TINY_ENGINE))
            stack.callback(engine.shutdown)
            port = stack.enter_context(serving(build_app(engine, "tiny")))
            servers[mode] = (engine, f"http://127.0.0.1:{port}")
        yield servers


def test_server_completion_precedence(tiny_servers, monkeypatch):
    engine, url = tiny_servers["auto"]
    seen = spy_params(engine, monkeypatch)
    base = {"model": "tiny", "prompt": PROMPT, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=base, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3  # the model's max_new_tokens
    assert (seen[-1].temperature, seen[-1].top_k, seen[-1].max_tokens) == (0.5, 7, 3)
    r = httpx.post(url + "/v1/completions", json={**base, "temperature": 0, "top_k": None, "max_tokens": 5},
                   timeout=60)
    assert r.json()["usage"]["completion_tokens"] == 5
    assert (seen[-1].temperature, seen[-1].top_k, seen[-1].max_tokens) == (0.0, 7, 5)  # null = absent


def test_chat_request_precedence():
    """The chat route maps its body the same way (the tiny model has no chat template to run it)."""
    from kvflow.entrypoints.openai import protocol as p

    defaults = {"temperature": 0.5, "top_k": 7, "max_tokens": 3}
    body = {"messages": [{"role": "user", "content": "hi"}]}
    params = p.ChatCompletionRequest(**body).to_sampling_params(5, 256, defaults)
    assert (params.temperature, params.top_k, params.max_tokens, params.top_p) == (0.5, 7, 3, 1.0)
    request = p.ChatCompletionRequest(**body, temperature=0, max_completion_tokens=4)
    params = request.to_sampling_params(5, 256, defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 7, 4)
    assert p.ChatCompletionRequest(**body).to_sampling_params(250, 256, defaults).max_tokens == 3
    assert p.ChatCompletionRequest(**body).to_sampling_params(254, 256, defaults).max_tokens == 2  # room left
    params = p.ChatCompletionRequest(**body).to_sampling_params(5, 256, None)  # engine defaults: vLLM's
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 0, 251)


def test_server_generation_config_vllm(tiny_servers, monkeypatch):
    engine, url = tiny_servers["vllm"]
    seen = spy_params(engine, monkeypatch)
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert (seen[-1].temperature, seen[-1].top_k, seen[-1].max_tokens) == (1.0, 0, 4)
    card = httpx.get(url + "/v1/models/tiny", timeout=10).json()
    assert card["sampling_defaults"] == {} and card["sampling_defaults_source"] == "vllm"


def test_models_route_shows_the_defaults(tiny_servers):
    _, url = tiny_servers["auto"]
    listed = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    expected = {"temperature": 0.5, "top_k": 7, "max_tokens": 3}
    assert [m["id"] for m in listed] == ["tiny"] and listed[0]["sampling_defaults"] == expected
    assert listed[0]["sampling_defaults_source"].endswith("generation_config.json")
    card = httpx.get(url + "/v1/models/tiny", timeout=10)
    assert card.status_code == 200 and card.json()["sampling_defaults"] == expected
    missing = httpx.get(url + "/v1/models/other", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
