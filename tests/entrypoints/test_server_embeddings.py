"""/v1/embeddings, in-process and split (engine core process): the OpenAI client's requests
(base64 by default, or floats) get the vectors `LLM.embed` gives, and bad requests get 400s
that name the field, with every block back in the pool."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from kvflow import PoolingParams
from kvflow.config import EngineConfig
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.core.client import EngineCoreClient
from kvflow.entrypoints.openai.server import build_app
from tests.entrypoints.conftest import API_KEY, ENGINE_KWARGS, MODEL_NAME, httpx, serving, wait_engine_idle

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors.", "kvflow"]


@pytest.fixture(scope="module", params=["in-process", "split"])
def server(request):
    config = EngineConfig(**ENGINE_KWARGS)
    engine = AsyncEngine.from_config(config) if request.param == "in-process" else EngineCoreClient(config)
    try:
        with serving(build_app(engine, MODEL_NAME, API_KEY)) as port, httpx.Client(
                base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {API_KEY}"},
                timeout=120) as http:
            yield port, http, engine
    finally:
        engine.shutdown()


def offline(llm, prompts, **params) -> list[torch.Tensor]:
    outs = llm.embed(prompts, PoolingParams(**params), use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outs]


def close(got, expected) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), expected, rtol=1e-5, atol=1e-6)


def test_openai_client_gets_llm_embed_vectors(server, smollm2_fp32):
    openai = pytest.importorskip("openai")
    port, _, _ = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY)
    expected = offline(smollm2_fp32, TEXTS)
    for encoding in ({}, {"encoding_format": "float"}):  # unless told, the client asks for base64 and decodes it
        resp = client.embeddings.create(model=MODEL_NAME, input=TEXTS, **encoding)
        assert [d.index for d in resp.data] == [0, 1, 2]
        for d, e in zip(resp.data, expected):
            close(d.embedding, e)
        tokenizer = smollm2_fp32.get_tokenizer()
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(tokenizer(t).input_ids) for t in TEXTS)
        assert resp.model == MODEL_NAME


def test_base64_is_little_endian_float32(server, smollm2_fp32):
    _, http, _ = server
    r = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    vector = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    close(vector.tolist(), offline(smollm2_fp32, TEXTS[:1])[0])


def test_token_ids_and_chat_messages(server, smollm2_fp32):
    _, http, _ = server
    tokenizer = smollm2_fp32.get_tokenizer()
    ids = [tokenizer(t).input_ids for t in TEXTS[:2]]
    r = http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": ids})
    assert r.status_code == 200, r.text
    for d, e in zip(r.json()["data"], offline(smollm2_fp32, [{"prompt_token_ids": i} for i in ids])):
        close(d["embedding"], e)
    messages = [{"role": "user", "content": "What is a vector?"}]
    r = http.post("/v1/embeddings", json={"model": MODEL_NAME, "messages": messages})
    assert r.status_code == 200, r.text
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    expected, = offline(smollm2_fp32, [{"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}])
    close(r.json()["data"][0]["embedding"], expected)


def test_options(server, smollm2_fp32):
    _, http, _ = server
    tokenizer = smollm2_fp32.get_tokenizer()
    r = http.post("/v1/embeddings", json={"input": TEXTS[0], "normalize": False, "truncate_prompt_tokens": 4})
    assert r.status_code == 200, r.text
    last4 = tokenizer(TEXTS[0]).input_ids[-4:]
    close(r.json()["data"][0]["embedding"], offline(smollm2_fp32, [{"prompt_token_ids": last4}], normalize=False)[0])
    assert r.json()["usage"]["prompt_tokens"] == 4
    again = http.post("/v1/embeddings", json={"input": TEXTS[1] * 8})  # 17 x 8 tokens: a cached block next time
    again = http.post("/v1/embeddings", json={"input": TEXTS[1] * 8})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("body, status, message", [
    ({}, 400, "give either `input` or `messages`"),
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "give either `input` or `messages`"),
    ({"input": []}, 400, "input: the list of inputs is empty"),
    ({"input": [[1, 2], []]}, 400, "input: an input is empty"),
    ({"input": ""}, 400, "input: an input is empty"),
    ({"input": "x", "dimensions": 64}, 400, "dimensions: this model does not support Matryoshka embeddings"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens must be a positive int or -1"),
    ({"input": [[1, 2, 49152]]}, 400, "token ids must be in [0, 49152)"),
    ({"input": [7] * 2049}, 400, "max_model_len is 2048"),
    ({"input": ["x"] * 2049}, 400, "at most 2048"),
    ({"input": "x", "model": "nope"}, 404, "nope"),
])
def test_bad_requests(server, body, status, message):
    _, http, engine = server
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"]
    if error["message"].startswith(("input:", "dimensions:")):
        assert error["param"] == error["message"].split(":")[0]
    assert wait_engine_idle(engine, 10)


def test_needs_the_api_key(server):
    port, _, _ = server
    r = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": "x"})
    assert r.status_code == 401
