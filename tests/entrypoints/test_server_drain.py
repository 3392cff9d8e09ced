"""SIGTERM drains: a real `kvflow serve` process on the default model, signalled as a deployment does.

The first SIGTERM must refuse new requests (503 in OpenAI's shape, /health 503) while the
stream in flight runs to its end, and then exit 0; past --shutdown-timeout the stream is ended
with an error event; a second SIGTERM exits at once. The middleware that counts and refuses
is also checked in-process, on a stub app, without a model.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvflow.entrypoints.openai.lifecycle import DrainMiddleware, DrainState

from .conftest import httpx

ROOT = Path(__file__).resolve().parents[2]
BOOT_TIMEOUT_S = 300  # importing torch and loading the model on a busy 2-core machine
NAME = "drain-test"


class ServeProcess:
    """`python -m kvflow.entrypoints.cli serve` on a free loopback port, logging to a file."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = tmp_path / "serve.log"
        self.log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--port", str(self.port),
               "--served-model-name", NAME, "--max-model-len", "2048", "--kv-cache-memory", "64MiB",
               "--uvicorn-log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"kvflow serve exited early:\n{self.output()}"
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"kvflow serve did not start:\n{self.output()}"
            time.sleep(0.5)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-4000:]

    def signal(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait_draining(self, client: httpx.Client) -> dict:
        """Poll /health until it reports draining; its error body."""
        deadline = time.monotonic() + 30
        while True:
            r = client.get("/health")
            if r.status_code == 503:
                return r.json()["error"]
            assert r.status_code == 200 and time.monotonic() < deadline, r.text
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture
def serve(tmp_path):
    started: list[ServeProcess] = []

    def start(*args: str) -> ServeProcess:
        started.append(ServeProcess(tmp_path, *args))
        return started[-1]

    yield start
    for s in started:
        s.close()


def body(max_tokens: int, stream: bool) -> dict:
    return {"model": NAME, "prompt": "Write a story about a lighthouse keeper.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def read_events(lines) -> list:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def assert_draining_refusal(r) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "draining"
    assert "shutting down" in err["message"] and int(r.headers["Retry-After"]) >= 1


def test_sigterm_drains_the_stream_in_flight_then_exits_0(serve):
    server = serve("--shutdown-timeout", "300")
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        alone = client.post("/v1/completions", json=body(150, False)).json()["choices"][0]["text"]
        with httpx.Client(base_url=server.base_url, timeout=300) as streaming:
            with streaming.stream("POST", "/v1/completions", json=body(150, True)) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                server.signal()
                health = server.wait_draining(client)
                assert health["code"] == "draining"
                # New requests, on a new connection, are refused while the stream goes on.
                assert_draining_refusal(client.post("/v1/completions", json=body(4, False)))
                assert_draining_refusal(client.post("/v1/chat/completions", json={
                    "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
                assert_draining_refusal(client.get("/v1/models"))
                assert server.proc.poll() is None  # still draining: the stream holds it open
                events = [first[len("data: "):], *read_events(lines)]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == alone
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(60) == 0, server.output()
    assert "drained" in server.output()


def test_shutdown_timeout_ends_the_stream_with_an_error_and_exits_0(serve):
    server = serve("--shutdown-timeout", "1")
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        with client.stream("POST", "/v1/completions", json=body(2000, True)) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            started = time.monotonic()
            server.signal()
            events = read_events(lines)
            took = time.monotonic() - started
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "shut down" in error["message"]
    assert took < 60, took  # 2000 tokens would take far longer: the timeout cut the request
    assert server.proc.wait(60) == 0, server.output()
    assert "shutdown timeout" in server.output()


def test_second_sigterm_exits_at_once(serve):
    server = serve("--shutdown-timeout", "600")
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        with client.stream("POST", "/v1/completions", json=body(2000, True)) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            server.signal()
            with httpx.Client(base_url=server.base_url, timeout=30) as other:
                server.wait_draining(other)
            server.signal()
            assert server.proc.wait(30) == 1, server.output()
            with pytest.raises(httpx.TransportError):  # the connection was cut: no [DONE]
                read_events(lines)
    assert "second SIGTERM" in server.output()


# ---- the middleware alone, on a stub app ----------------------------------------------------
def test_drain_middleware_counts_streams_and_refuses_while_draining():
    gate = asyncio.Event()

    async def app(scope, receive, send):  # a /v1 stream that ends when the test opens the gate
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await gate.wait()
        await send({"type": "http.response.body", "body": b"last", "more_body": False})

    state = DrainState()
    wrapped = DrainMiddleware(app, state)

    async def call(path: str) -> tuple[int, dict, bytes]:
        sent: list[dict] = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
        await wrapped(scope, receive, send)
        start = sent[0]
        return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])

    async def run() -> None:
        stream = asyncio.ensure_future(call("/v1/completions"))
        await asyncio.sleep(0.01)
        assert state.in_flight == 1
        assert not await state.wait_idle(0.05)  # the stream holds it
        state.draining = True
        status, headers, payload = await call("/v1/completions")
        assert status == 503 and headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
        assert json.loads(payload)["error"]["code"] == "draining"
        status, _, payload = await call("/health")
        assert status == 503 and json.loads(payload)["error"]["code"] == "draining"
        status, _, payload = await call("/dashboard/events")  # an endless feed would hold up the exit
        assert status == 503 and json.loads(payload)["error"]["code"] == "draining"
        assert state.in_flight == 1  # refusals are not counted
        gate.set()
        assert await state.wait_idle(5) and await stream == (200, {b"content-type": b"text/plain"}, b"firstlast")
        status, _, payload = await call("/metrics")  # what is not /v1 or /health still answers
        assert status == 200 and state.in_flight == 0

    asyncio.run(run())
