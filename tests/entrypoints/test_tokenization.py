"""/tokenize and /detokenize: the counts a client gets are the prompt_tokens the generating routes bill."""

from __future__ import annotations

import pytest

from .conftest import MODEL_NAME, httpx

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]


def _post(http, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_counts_match_the_completion_and_chat_usage(live_server, http):
    done = _post(http, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1})
    tok = _post(http, "/tokenize", {"model": MODEL_NAME, "prompt": PROMPT})
    assert tok["count"] == len(tok["tokens"]) == done["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == live_server.engine.max_model_len
    assert tok["tokens"] == live_server.engine.tokenizer(PROMPT).input_ids

    chat = _post(http, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1})
    tok_chat = _post(http, "/tokenize", {"messages": MESSAGES})
    assert tok_chat["count"] == chat["usage"]["prompt_tokens"]
    no_prompt = _post(http, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert no_prompt["count"] < tok_chat["count"] and tok_chat["tokens"][:no_prompt["count"]] == no_prompt["tokens"]
    assert live_server.wait_pool_free()


def test_detokenize_inverts_tokenize_and_token_strs_name_each_token(http):
    text = "Ünïcödé, emoji 🦊 and\nnew lines"
    tok = _post(http, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert len(tok["token_strs"]) == tok["count"] and all(isinstance(s, str) for s in tok["token_strs"])
    assert _post(http, "/detokenize", {"model": MODEL_NAME, "tokens": tok["tokens"]})["prompt"] == text


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/tokenize", {"model": "other", "prompt": "hi"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_requests_say_which_field(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_the_api_key_guards_both_routes(live_server):
    for path in ("/tokenize", "/detokenize"):
        r = httpx.post(live_server.base_url + path, json={"prompt": "hi", "tokens": [1]}, timeout=10)
        assert r.status_code == 401, (path, r.text)


def test_continue_final_message_continues_the_assistants_text(live_server, http, offline_llm):
    conversation = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    tok = _post(http, "/tokenize", {"messages": conversation, **options})
    want = offline_llm.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True)
    assert tok["tokens"] == want["prompt_token_ids"]
    done = _post(http, "/v1/chat/completions", {"model": MODEL_NAME, "messages": conversation, "max_tokens": 4,
                                                 "temperature": 0, **options})
    assert done["usage"]["prompt_tokens"] == tok["count"]
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": conversation,
                                                "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    assert live_server.wait_pool_free()
