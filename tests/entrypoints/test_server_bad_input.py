"""Bad input gets a clear 400 in OpenAI's error shape, and harms nobody else.

Each refusal names the field (`param`) and, where a limit is involved, the numbers; after
every one the engine holds no request and every KV block is back in the pool. One server
(SmolLM2-135M, float32, max_model_len 2048, vocabulary 49152) serves the module.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading

import pytest

from kvflow.sampling.params import MAX_LOGPROBS

from kvflow.entrypoints.openai.server import build_app

from .conftest import MODEL_NAME, httpx, serving

VOCAB = 49152
MAX_MODEL_LEN = 2048
CHAT = [{"role": "user", "content": "Name three colors."}]
CMPL, CHATP = "/v1/completions", "/v1/chat/completions"


def refused(r, param: str | None, status: int = 400, *must_mention: str) -> dict:
    """The response is `status` in OpenAI's error shape, naming `param`, with each of `must_mention`."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert err["param"] == param, err
    for text in must_mention:
        assert text in err["message"], (text, err["message"])
    return err


@pytest.fixture(autouse=True)
def pool_free_after(live_server):
    """Whatever a test sent, the engine is idle and the pool full afterwards."""
    yield
    assert live_server.wait_pool_free(), live_server.engine.get_stats()
    live_server.engine.engine.check_integrity()


# ---- token ids and lengths ------------------------------------------------------------------
@pytest.mark.parametrize("ids", [[VOCAB], [1, 2, VOCAB + 1000], [-1], [5, -7, 9], [10**20]],
                         ids=["vocab", "past-vocab", "minus-one", "negative-inside", "huge"])
def test_out_of_vocabulary_token_ids(http, ids):
    r = http.post(CMPL, json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 2})
    refused(r, "prompt", 400, f"[0, {VOCAB})")


def test_out_of_vocabulary_ids_in_a_batch_of_one(http):
    r = http.post(CMPL, json={"model": MODEL_NAME, "prompt": [[3, VOCAB]], "max_tokens": 2})
    refused(r, "prompt", 400, f"[0, {VOCAB})")


@pytest.mark.parametrize("prompt", [[1] * MAX_MODEL_LEN, [1] * (MAX_MODEL_LEN + 500), "word " * 4000],
                         ids=["exactly-max", "over-max", "long-text"])
def test_prompt_longer_than_max_model_len(http, prompt):
    err = refused(http.post(CMPL, json={"model": MODEL_NAME, "prompt": prompt}), "prompt", 400, str(MAX_MODEL_LEN))
    assert err["code"] == "context_length_exceeded"


def test_chat_longer_than_max_model_len(http):
    messages = [{"role": "user", "content": "word " * 4000}]
    err = refused(http.post(CHATP, json={"model": MODEL_NAME, "messages": messages}), "messages", 400,
                  str(MAX_MODEL_LEN))
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("field,path", [("max_tokens", CMPL), ("max_tokens", CHATP),
                                        ("max_completion_tokens", CHATP)])
def test_max_tokens_beyond_the_context(live_server, http, field, path):
    """400 as vLLM answers it, with max_model_len, the prompt's length and the request's sum."""
    ids = [1, 2, 3, 4, 5]
    body = {"model": MODEL_NAME, field: MAX_MODEL_LEN}
    body.update({"prompt": ids} if path == CMPL else {"messages": CHAT})
    tok = live_server.engine.tokenizer
    prompt_len = 5 if path == CMPL else len(tok(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                                                add_special_tokens=False).input_ids)
    err = refused(http.post(path, json=body), field, 400, str(MAX_MODEL_LEN), str(prompt_len),
                  str(prompt_len + MAX_MODEL_LEN))
    assert err["code"] == "context_length_exceeded"


def test_max_tokens_boundary_is_exact():
    """The largest max_tokens that fits is accepted and one more is refused (no server needed)."""
    from kvflow.entrypoints.openai import protocol as p

    assert p.CompletionRequest(prompt=[1], max_tokens=MAX_MODEL_LEN - 10).to_sampling_params(10, MAX_MODEL_LEN)
    with pytest.raises(p.InvalidRequestError, match=f"{MAX_MODEL_LEN + 1} tokens"):
        p.CompletionRequest(prompt=[1], max_tokens=MAX_MODEL_LEN - 9).to_sampling_params(10, MAX_MODEL_LEN)


# ---- absurd sizes ---------------------------------------------------------------------------
@pytest.mark.parametrize("path,extra,param", [
    (CMPL, {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    (CMPL, {"logprobs": 10**9}, "logprobs"),
    (CMPL, {"logprobs": -1}, "logprobs"),
    (CMPL, {"prompt_logprobs": 10**6}, "prompt_logprobs"),
    (CHATP, {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    (CHATP, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (CHATP, {"logprobs": False, "top_logprobs": 10**9}, "top_logprobs"),
    (CHATP, {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else str(v))
def test_absurd_logprobs(http, path, extra, param):
    body = {"model": MODEL_NAME, "max_tokens": 2, **extra}
    body.update({"prompt": "hi"} if path == CMPL else {"messages": CHAT})
    err = refused(http.post(path, json=body), param, 400)
    if abs(extra.get(param, 0)) > MAX_LOGPROBS:
        assert str(MAX_LOGPROBS) in err["message"]


@pytest.mark.parametrize("n", [10**9, 10**6, 0, -1], ids=str)
@pytest.mark.parametrize("path", [CMPL, CHATP])
def test_absurd_n(http, path, n):
    body = {"model": MODEL_NAME, "max_tokens": 2, "n": n}
    body.update({"prompt": "hi"} if path == CMPL else {"messages": CHAT})
    refused(http.post(path, json=body), "n", 400)


@pytest.mark.parametrize("seed", [2**64, -(2**64), 2**200], ids=["2^64", "-2^64", "2^200"])
def test_seed_out_of_range(http, seed):
    refused(http.post(CMPL, json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "seed": seed}), "seed")


@pytest.mark.parametrize("seed", [0, 2**64 - 1, -(2**63)], ids=["0", "uint64-max", "int64-min"])
def test_seed_int64_range_is_served(http, seed):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "seed": seed, "temperature": 1.0}
    assert http.post(CMPL, json=body).status_code == 200


@pytest.mark.parametrize("field", ["top_k", "priority", "truncate_prompt_tokens", "min_tokens"])
@pytest.mark.parametrize("value", [2**64, 2**70], ids=["2^64", "2^70"])
def test_counts_beyond_64_bits_name_their_field(http, field, value):
    """The engine core's wire packs 64-bit integers: a bigger count is refused by name in every
    engine mode (the split core blamed `prompt`, the in-process engine took it)."""
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, field: value}
    refused(http.post(CMPL, json=body), field)


# ---- bodies that are not the JSON they should be --------------------------------------------
@pytest.mark.parametrize("raw", [
    b"{not json", b"", b"[]", b"null", b'"a string"', b'{"model": "x", "prompt": "hi"',
    b'{"prompt": "\xff\xfe broken utf-8", "max_tokens": 2}', b"\xff\xfe\x00\x00", b"\x00" * 64,
], ids=["garbage", "empty", "array", "null", "string", "truncated", "bad-utf8-in-string", "bad-utf8", "nul-bytes"])
@pytest.mark.parametrize("path", [CMPL, CHATP])
def test_malformed_bodies(http, path, raw):
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    refused(r, None, 400)


@pytest.mark.parametrize("path,body,param", [
    (CMPL, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (CMPL, {"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": [3]}, "max_tokens"),
    (CMPL, {"prompt": "hi", "stream": "perhaps"}, "stream"),
    (CMPL, {"prompt": "hi", "stop": 5}, "stop"),
    (CMPL, {"prompt": "hi", "stop": [""]}, "stop"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [-3]}, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "seed": "x"}, "seed"),
    (CMPL, {"prompt": {"text": "hi"}}, "prompt"),
    (CMPL, {"prompt": [1.5, 2]}, "prompt"),
    (CMPL, {"prompt": ""}, "prompt"),
    (CMPL, {"prompt": "hi", "stream_options": "yes"}, "stream_options"),
    (CMPL, {"prompt": "hi", "min_tokens": 10, "max_tokens": 2}, "min_tokens"),
    (CHATP, {"messages": "hello"}, "messages"),
    (CHATP, {"messages": [{"role": "user"}, 7]}, "messages"),
    (CHATP, {"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]}, "messages"),
    (CHATP, {"messages": CHAT, "logprobs": "maybe"}, "logprobs"),
    (CHATP, {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "messages"),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else str(v))
def test_wrong_types_and_values(http, path, body, param):
    refused(http.post(path, json={"model": MODEL_NAME, "max_tokens": 2, **body}), param, 400)


@pytest.mark.parametrize("literal,param", [("NaN", "temperature"), ("Infinity", "temperature"),
                                           ("-Infinity", "top_p"), ("1e400", "presence_penalty")])
def test_non_finite_numbers(http, literal, param):
    """Python's JSON parser accepts NaN and Infinity; the sampling checks must still refuse them."""
    raw = '{"model": "%s", "prompt": "hi", "max_tokens": 2, "%s": %s}' % (MODEL_NAME, param, literal)
    refused(http.post(CMPL, content=raw, headers={"Content-Type": "application/json"}), param, 400)


@pytest.mark.parametrize("path,field", [(CMPL, "prompt"), (CHATP, "messages"), (CMPL, "model")])
def test_lone_surrogates(http, path, field):
    """A JSON \\ud800 escape is legal JSON but not Unicode a tokenizer (or a UTF-8 encoder) takes."""
    body = {"model": MODEL_NAME, "max_tokens": 2}
    body.update({"prompt": "hi"} if path == CMPL else {"messages": CHAT})
    if field == "prompt":
        body["prompt"] = "bad \ud800 text"
    elif field == "messages":
        body["messages"] = [{"role": "user", "content": "bad \udfff text"}]
    else:
        body["model"] = "no-such-\ud800"
    raw = json.dumps(body)  # ensure_ascii writes the surrogate as an escape
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    refused(r, field, 404 if field == "model" else 400)


def test_body_over_the_limit_is_refused_before_it_is_read(live_server):
    """413 in OpenAI's shape, for a declared Content-Length and for a chunked body alike."""
    limit = 4096
    app = build_app(live_server.engine, MODEL_NAME, None, max_request_bytes=limit)
    big = json.dumps({"model": MODEL_NAME, "prompt": "x" * (2 * limit), "max_tokens": 2}).encode()

    def chunked():
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    with serving(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        for content in (big, chunked()):
            r = c.post(CMPL, content=content, headers={"Content-Type": "application/json"})
            assert refused(r, None, 413, str(limit))["code"] == "request_too_large"
        small = {"model": MODEL_NAME, "prompt": "x" * 100, "max_tokens": 2}
        assert c.post(CMPL, json=small).status_code == 200  # under the limit: served


# ---- prompts of megabytes --------------------------------------------------------------------
HUGE = "hello world " * 200_000  # 2.4 MB, 400,001 tokens: whole, about a second and a half to tokenize


@pytest.mark.parametrize("path,field", [(CMPL, "prompt"), (CHATP, "messages")])
def test_a_megabyte_prompt_is_refused_on_its_head(http, path, field):
    """Counted on its first 16 x 2048 characters (prompt_ids.encode), not tokenized whole."""
    body = {"model": MODEL_NAME, "max_tokens": 2}
    body.update({"prompt": HUGE} if path == CMPL else {"messages": [{"role": "user", "content": HUGE}]})
    err = refused(http.post(path, json=body), field, 400, "maximum context length is 2048 tokens",
                  "characters alone are")
    assert err["code"] == "context_length_exceeded"


def test_a_megabyte_prompt_is_tokenized_whole_where_asked(http):
    """truncate_prompt_tokens keeps the last tokens of the whole text; /tokenize counts it all."""
    body = {"model": MODEL_NAME, "prompt": HUGE, "max_tokens": 2, "truncate_prompt_tokens": 100}
    r = http.post(CMPL, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 100
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": HUGE})
    assert r.status_code == 200 and r.json()["count"] == 400_001  # "hello" and " world" each time, then " "


def test_tokenizing_leaves_the_event_loop_free(live_server, http):
    """A prompt is tokenized off the event loop: while one is held inside the tokenizer, /health
    still answers (on the loop it would wait for the tokenizer, and this test would fail)."""
    engine = live_server.engine.engine
    real = engine.tokenizer
    entered, release = threading.Event(), threading.Event()

    class HeldTokenizer:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, text, *args, **kwargs):
            if text == "hold this prompt":
                entered.set()
                release.wait(60)
            return real(text, *args, **kwargs)

    engine.tokenizer = HeldTokenizer()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool, \
                httpx.Client(base_url=live_server.base_url, headers=live_server.headers, timeout=10) as other:
            pending = pool.submit(http.post, CMPL, json={"model": MODEL_NAME, "prompt": "hold this prompt",
                                                         "max_tokens": 2})
            assert entered.wait(30)
            assert other.get("/health").status_code == 200
            release.set()
            assert pending.result(60).status_code == 200
    finally:
        release.set()
        engine.tokenizer = real


def test_good_request_still_served_after_abuse(live_server, http, offline_llm):
    """The refusals above touched nobody: a greedy request answers as LLM.generate does."""
    from kvflow import SamplingParams

    r = http.post(CMPL, json={"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8,
                              "temperature": 0})
    assert r.status_code == 200, r.text
    expected = offline_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                                    use_tqdm=False)[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == expected
