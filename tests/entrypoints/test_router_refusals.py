"""`kvflow router` over `Fake` instances in the test process: kvflow's own middleware and error
handlers around canned answers, for what a real instance does not do on cue: refuse
(overloaded, draining), fail with a 4xx or 500, want an API key, not be a KV producer.
(test_router.py runs it over real `kvflow serve` processes.)"""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
from fastapi import FastAPI, Request  # at module level: the fakes' routes name Request in their annotations
from fastapi.responses import StreamingResponse

from kvflow.entrypoints import router as router_module
from kvflow.entrypoints.router import Router, build_router_app

from .conftest import eventually, httpx, serving

NAME = "tiny"


class Fake:
    """A stand-in for `kvflow serve` with its middleware (API key, drain) and error handlers:
    /v1/completions answers its name, or fails as `mode` says (overloaded, draining, bad,
    step_failed, dead, cut: a stream that breaks after its first event). Records every request."""

    def __init__(self, name: str, mode: str = "ok", api_key: str | None = None, kv_role: str | None = None) -> None:
        from kvflow.entrypoints.async_engine import EngineDeadError, EngineOverloadedError, EngineStepError
        from kvflow.entrypoints.openai.auth import APIKeyMiddleware
        from kvflow.entrypoints.openai.errors import add_error_handlers, error_response
        from kvflow.entrypoints.openai.lifecycle import DrainMiddleware, DrainState

        self.name, self.mode, self.url = name, mode, ""
        self.got: list[tuple[str, str]] = []  # (method, path) of every request but /health
        self.bodies: list[dict] = []  # what /v1/completions was sent
        app, self.drain = FastAPI(), DrainState()
        add_error_handlers(app)
        if api_key:
            app.add_middleware(APIKeyMiddleware, api_key=api_key)
        app.add_middleware(DrainMiddleware, state=self.drain)
        app.get("/health")(lambda: {})
        app.get("/metrics")(lambda: "")
        app.get("/version")(lambda: {"version": "fake"})
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": NAME}]})
        app.get("/v1/models/{model_id:path}")(lambda model_id: {"id": model_id})

        @app.get("/kv_transfer")
        async def kv_transfer():
            if kv_role is None:
                return error_response(404, "this instance has no --kv-transfer-config", code="kv_transfer_disabled")
            return {"kv_role": kv_role, "kv_addr": "tcp://127.0.0.1:1" if kv_role == "kv_producer" else None}

        @app.post("/v1/completions")
        async def completions(raw: Request):
            body = await raw.json()
            self.bodies.append(body)
            fail = {"overloaded": EngineOverloadedError(9, 8), "bad": ValueError("temperature must be >= 0"),
                    "step_failed": EngineStepError("boom"), "dead": EngineDeadError("gone")}.get(self.mode)
            if fail is not None:
                raise fail
            if not body.get("stream"):
                return {"choices": [{"text": name}]}

            async def events():
                yield f'data: {{"choices": [{{"text": "{name}"}}]}}\n\n'.encode()
                if self.mode == "cut":
                    raise RuntimeError("the instance died mid-stream")
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        async def asgi(scope, receive, send):
            if scope["type"] == "http":
                self.drain.draining = self.mode == "draining"  # /health and /v1 answer 503 draining
                if scope["path"] != "/health":
                    self.got.append((scope["method"], scope["path"]))
            await app(scope, receive, send)
        self.app = asgi

    def posts(self) -> int:
        return sum(method == "POST" for method, _ in self.got)


@contextlib.contextmanager
def fleet(decode: list[Fake], prefill: list[Fake] = (), **kw):
    """The fakes on loopback ports and a router over them: yields the router and a client of it."""
    with contextlib.ExitStack() as stack:
        for fake in (*decode, *prefill):
            fake.url = f"http://127.0.0.1:{stack.enter_context(serving(fake.app))}"
        router = Router([f.url for f in decode], prefill_urls=[f.url for f in prefill], **kw)
        port = stack.enter_context(serving(build_router_app(router)))
        yield router, stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30))


def ask(http, n: int, stream: bool = False):
    """Prompt n (a 40-character text of its own, so a fresh record); the response, or a stream's events."""
    body = {"model": NAME, "prompt": f"prompt {n:03d} " * 4, "max_tokens": 4, "stream": stream}
    if not stream:
        return http.post("/v1/completions", json=body)
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_refusals_go_to_another_instance_and_nothing_else_does():
    a, b = Fake("a", "overloaded"), Fake("b")
    with fleet([a, b]) as (router, http):
        # A fresh prompt goes to a first (equal loads and records): a refuses, b answers.
        assert ask(http, 1).json()["choices"][0]["text"] == "b"
        assert ask(http, 2, stream=True) == ['{"choices": [{"text": "b"}]}', "[DONE]"]
        assert (a.posts(), b.posts(), router.refused["overloaded"]) == (2, 2, 2)
        # a computed nothing: it holds no record of those prompts (later ones would be steered to it),
        # b holds both; nothing is left counted in flight
        assert len(router.instances[0].index) == 0 and len(router.instances[1].index) > 0
        assert [i.in_flight for i in router.instances] == [0, 0]
        b.mode = "overloaded"  # every instance refuses: the client gets the last refusal
        r = ask(http, 3)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"]
        assert (a.posts(), b.posts()) == (3, 3)
        a.mode, b.mode = "draining", "ok"  # refused, and a is left out until its /health answers 200
        assert ask(http, 4).json()["choices"][0]["text"] == "b" and not router.instances[0].healthy
        a_posts = a.posts()
        assert ask(http, 5).json()["choices"][0]["text"] == "b" and a.posts() == a_posts
        a.mode = "ok"
        assert eventually(lambda: router.instances[0].healthy)  # the next health poll
        # Anything but a refusal is the client's answer, even a 503: a (the smaller record, then the
        # prompt's cache) answers each, b never sees them.
        b_posts = b.posts()
        for mode, status in (("bad", 400), ("step_failed", 500), ("dead", 503)):
            a.mode = mode
            assert ask(http, 6).status_code == status
        a.mode = "cut"  # a stream that started is not run again elsewhere: it ends with an error event
        events = ask(http, 6, stream=True)
        assert events[0] == '{"choices": [{"text": "a"}]}'
        assert json.loads(events[1])["error"]["code"] == "instance_failed"  # a string, as a whole answer's
        assert events[-1] == "[DONE]" and b.posts() == b_posts


def test_disaggregated_refusals_and_prefill_counts():
    p, d1, d2 = Fake("p", kv_role="kv_producer"), Fake("d1", "overloaded"), Fake("d2")
    with fleet([d1, d2], prefill=[p]) as (router, http):
        assert ask(http, 1).json()["choices"][0]["text"] == "d2"  # d1 refused the decode half
        assert d2.bodies[0]["kv_transfer_params"] == {"do_remote_prefill": True, "remote_kv_addr": "tcp://127.0.0.1:1"}
        assert eventually(lambda: router.disaggregated["remote_prefill"] == 1) and p.bodies[0]["max_tokens"] == 1
        metrics = http.get("/metrics").text
        assert f'kvflow_router_requests_total{{instance="{p.url}",role="prefill"}} 1' in metrics
        assert f'kvflow_router_requests_total{{instance="{d2.url}",role="decode"}} 1' in metrics
        assert f'kvflow_router_requests_total{{instance="{d1.url}",role="decode"}} 0' in metrics
        assert 'kvflow_router_refused_total{code="overloaded"} 1' in metrics
        p.mode = "draining"  # its refusal takes it out of the next requests' choice
        assert ask(http, 2).json()["choices"][0]["text"] == "d2"
        assert eventually(lambda: not router.prefills[0].healthy)
        assert ask(http, 3).status_code == 200 and "kv_transfer_params" not in d2.bodies[-1]


def test_get_routes_carry_the_api_key_and_unknown_paths_are_openai_errors():
    a, b = Fake("a", api_key="k"), Fake("b", api_key="k")
    with fleet([a, b]) as (router, http):
        key = {"Authorization": "Bearer k"}
        assert http.get("/v1/models", headers=key).json()["data"][0]["id"] == NAME
        assert http.get("/v1/models").status_code == 401  # the instance's answer to no key
        assert http.get("/v1/models/org/tiny", headers=key).json() == {"id": "org/tiny"}
        assert http.get("/version").json() == {"version": "fake"}
        a.mode = "draining"  # a refusal passes the GET on to the next instance
        assert http.get("/v1/models", headers=key).status_code == 200 and ("GET", "/v1/models") in b.got
        for method, path in (("GET", "/nope"), ("POST", "/v1/nope"), ("DELETE", "/v1/models")):
            via, direct = http.request(method, path, headers=key), httpx.request(method, b.url + path, headers=key)
            assert via.status_code == direct.status_code in (404, 405) and via.json() == direct.json()
            assert set(via.json()["error"]) == {"message", "type", "param", "code"}


def test_misconfigured_instances_fail_loudly(caplog, monkeypatch):
    import uvicorn

    from kvflow.entrypoints.cli import build_parser

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    for argv, flag in ((["--instance", "127.0.0.1:8101"], "--instance"), (["--decode", "ftp://h:1"], "--decode"),
                       (["--instance", "http://h:1", "--prefill", "localhost:8102"], "--prefill"),
                       (["--instance", "http://h:99999"], "--instance")):
        args = build_parser().parse_args(["router", *argv])
        with pytest.raises(ValueError, match=f"{flag}.*http://host:port"):
            args.func(args)
    assert Router(["https://h:8101/"]).instances[0].url == "https://h:8101"
    # An up --prefill instance that is no KV producer: one warning naming it and why, and /health says so.
    monkeypatch.setattr(router_module, "HEALTH_INTERVAL_S", 0.05)
    caplog.set_level(logging.WARNING, logger="kvflow")
    p, d = Fake("p"), Fake("d")
    with fleet([d], prefill=[p]) as (router, http):
        assert eventually(lambda: p.got.count(("GET", "/kv_transfer")) >= 3)
        warned = [r.getMessage() for r in caplog.records if "not a KV producer" in r.getMessage()]
        assert len(warned) == 1 and p.url in warned[0] and "kv_transfer_disabled" in warned[0]
        health = http.get("/health").json()
        assert health["status"] == "degraded" and "kv_transfer_disabled" in health["instances"][1]["problem"]
        assert ask(http, 1).status_code == 200 and router.disaggregated["fallback"] == 1


def test_router_command_quiets_the_http_client_logs(caplog, monkeypatch):
    import uvicorn

    from kvflow.entrypoints.cli import build_parser

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    caplog.set_level(logging.INFO)  # as `kvflow router` runs: an INFO line per health poll unless quieted
    names = ("httpx", "httpcore", "httpx2", "httpcore2")
    levels = {name: logging.getLogger(name).level for name in names}
    try:
        args = build_parser().parse_args(["router", "--instance", "http://127.0.0.1:1"])
        assert args.func(args) == 0
        assert not logging.getLogger(httpx.__name__).isEnabledFor(logging.INFO)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
