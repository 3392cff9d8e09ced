"""LoRA adapters through the OpenAI server, in-process and split (engine core process): the
adapter's name picks it, /v1/models lists it, responses carry its name, unknown names are 404s,
and adapters load and unload at run time where that is allowed."""

from __future__ import annotations

import pytest

from kvflow import LLM, LoRARequest, SamplingParams
from kvflow.config import EngineConfig
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.core.client import EngineCoreClient
from kvflow.entrypoints.openai.server import build_app
from tests.entrypoints.conftest import httpx, serving

BASE = "tiny-base"
PROMPT = [5, 17, 42, 99, 3, 8, 250, 11, 64, 2, 77]
NEW = 10


@pytest.fixture(scope="module", params=["in-process", "split"])
def lora_server(request, lora_models):
    root = lora_models["root"]
    config = EngineConfig(model=lora_models["path"], dtype="float32", kv_cache_memory=32 << 20, enable_lora=True,
                          max_loras=2, generation_config="vllm")
    engine = (AsyncEngine.from_config(config) if request.param == "in-process"
              else EngineCoreClient(config, max_waiting=64))
    app = build_app(engine, BASE, lora_modules=[f"all={root / 'all'}", f'{{"name": "qv", "path": "{root / "qv"}"}}'],
                    allow_runtime_lora_updating=True)
    try:
        with serving(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            yield http
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def offline(lora_models):
    """The same adapters through `LLM`: what the server must answer."""
    llm = LLM(lora_models["path"], dtype="float32", kv_cache_memory=32 << 20, enable_lora=True, max_loras=3)
    root = lora_models["root"]

    def tokens(name: str | None) -> list[int]:
        lora = None if name is None else LoRARequest(name, {"all": 1, "qv": 2, "mlp": 3}[name], str(root / name))
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=NEW,
                                                                           ignore_eos=True),
                           use_tqdm=False, lora_request=lora)
        return out[0].outputs[0].token_ids

    return tokens


def generated_ids(http, model: str, route: str = "/v1/completions") -> tuple[str, list[int]]:
    """The response's model name and its token ids (the tiny model has no tokenizer: logprobs name
    tokens as token_id:N)."""
    body = {"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": NEW, "ignore_eos": True, "logprobs": 0}
    r = http.post(route, json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["model"], [int(t.removeprefix("token_id:")) for t in data["choices"][0]["logprobs"]["tokens"]]


def test_models_lists_the_adapters(lora_server, lora_models):
    data = lora_server.get("/v1/models").json()["data"]
    cards = {card["id"]: card for card in data}
    assert list(cards)[:3] == [BASE, "all", "qv"]
    assert cards["all"]["parent"] == BASE and cards["all"]["root"] == str(lora_models["root"] / "all")
    assert cards[BASE]["parent"] is None
    assert lora_server.get("/v1/models/qv").json()["id"] == "qv"
    assert lora_server.get("/v1/models/nope").status_code == 404


def test_each_name_runs_its_adapter(lora_server, offline):
    for name in ("all", "qv", BASE):
        model, ids = generated_ids(lora_server, name)
        assert model == name
        assert ids == offline(None if name == BASE else name), name
    assert offline("all") != offline(None)


def test_streaming_carries_the_adapter_name(lora_server):
    body = {"model": "qv", "prompt": PROMPT, "max_tokens": 3, "stream": True, "temperature": 0}
    with lora_server.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    import json

    assert events and all(json.loads(e)["model"] == "qv" for e in events)


def test_unknown_model_is_404(lora_server):
    r = lora_server.post("/v1/completions", json={"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_adapters_load_and_unload_at_run_time(lora_server, lora_models, offline, tmp_path):
    root = lora_models["root"]
    r = lora_server.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(root / "mlp")})
    assert r.status_code == 200, r.text
    assert generated_ids(lora_server, "mlp")[1] == offline("mlp")
    again = lora_server.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(root / "mlp")})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    missing = lora_server.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "no")})
    assert missing.status_code == 400 and "not a directory" in missing.json()["error"]["message"]
    r = lora_server.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert r.status_code == 200, r.text
    assert lora_server.post("/v1/completions", json={"model": "mlp", "prompt": PROMPT}).status_code == 404
    assert lora_server.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 404
    assert "mlp" not in [card["id"] for card in lora_server.get("/v1/models").json()["data"]]


def test_an_adapter_that_does_not_fit_is_refused_at_load(lora_server, lora_models, tmp_path):
    """Rank 16 against max_lora_rank 16 fits; a folder whose tensors are for another model does not."""
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(lora_models["root"] / "all", bad)
    from safetensors.torch import load_file, save_file

    tensors = load_file(bad / "adapter_model.safetensors")
    tensors = {k: (v[:, :-1].contiguous() if "lora_A" in k else v) for k, v in tensors.items()}
    save_file(tensors, bad / "adapter_model.safetensors")
    r = lora_server.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400
    assert "the base model needs A" in json.loads(r.text)["error"]["message"]
    assert "bad" not in [card["id"] for card in lora_server.get("/v1/models").json()["data"]]
