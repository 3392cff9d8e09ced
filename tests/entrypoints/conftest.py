"""A real kvflow server on a loopback port, started once per test module.

The server runs uvicorn in a background thread of the test process, so tests can drive it
over HTTP like any client and still read the engine's own stats (free blocks) directly.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import pytest

try:
    import httpx
except ImportError:  # the openai client may ship its HTTP stack as `httpx2`
    import httpx2 as httpx  # type: ignore[no-redef]

import uvicorn

from kvflow.config import EngineConfig
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.openai.server import build_app

API_KEY = "test-key"
MODEL_NAME = "smollm2"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
# float32 so that greedy text through the server equals LLM.generate bit for bit.
ENGINE_KWARGS = dict(dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048, seed=0)


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str
    model: str
    engine: AsyncEngine

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def wait_pool_free(self, timeout: float = 30.0) -> bool:
        """True once every KV block is back in the pool (idle cached blocks count as free)."""
        return wait_engine_idle(self.engine, timeout)


def wait_engine_idle(engine: AsyncEngine, timeout: float) -> bool:
    """True once nothing runs or waits and every KV block is back in the pool (idle cached
    blocks count as free); False if `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.get_stats()
        if stats.num_free_blocks == stats.num_blocks and stats.num_running == 0 and stats.num_waiting == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def eventually(check, timeout: float = 10.0) -> bool:
    """True once `check()` is, polled every 20 ms; False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def start_uvicorn(app) -> tuple[uvicorn.Server, threading.Thread, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread, port


@contextlib.contextmanager
def serving(app) -> Iterator[int]:
    """`app` on a loopback port (uvicorn in a thread) for the with-block; yields the port."""
    server, thread, port = start_uvicorn(app)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def live_server():
    engine = AsyncEngine.from_config(EngineConfig(**ENGINE_KWARGS), max_waiting=1024)
    try:
        with serving(build_app(engine, MODEL_NAME, API_KEY)) as port:
            yield LiveServer(f"http://127.0.0.1:{port}", API_KEY, MODEL_NAME, engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="session")
def offline_llm(smollm2_fp32):
    """An offline `LLM` with the server's engine settings, sharing nothing with any server.

    The session's shared fp32 engine (tests/conftest.py) has exactly ENGINE_KWARGS, so
    reusing it saves a weight load.
    """
    return smollm2_fp32


@pytest.fixture(scope="module")
def client(live_server) -> "openai.OpenAI":  # noqa: F821 (imported here: modules without it still collect)
    """The official OpenAI client on the module's server."""
    import openai

    return openai.OpenAI(base_url=live_server.v1, api_key=live_server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, headers=live_server.headers, timeout=120) as client:
        yield client


def check_cache_salt(post, route: str, body: dict) -> None:
    """vLLM's cache_salt through a server: `post(route, json)` returns the response. A fresh prompt is
    cached for its own salt only, usage.prompt_tokens_details.cached_tokens says so, and the text is
    the same whatever the salt."""
    import uuid

    words = " ".join(uuid.uuid4().hex for _ in range(12))  # a prompt no earlier test sent: several blocks
    body = {**body, "temperature": 0, "max_tokens": 4}
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    answers = []
    for salt in ("tenant-a", "tenant-b", "tenant-a", None):
        r = post(route, {**body, **({"cache_salt": salt} if salt else {})})
        assert r.status_code == 200, r.text
        answers.append(r.json())
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    # The unsalted request may find the blocks of a chat template's opening that earlier unsalted
    # requests cached, never the salted ones (which cover the whole prompt).
    assert cached[0] == cached[1] == 0 and cached[2] > cached[3], cached
    texts = [(a["choices"][0].get("text") or a["choices"][0]["message"]["content"]) for a in answers]
    assert all(t == texts[0] for t in texts)
    r = post(route, {**body, "cache_salt": ""})
    assert r.status_code == 400 and "cache_salt" in r.text
