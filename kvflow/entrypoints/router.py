"""`kvflow router`: one OpenAI address in front of N identical `kvflow serve` instances.

The router never tokenizes or generates: it reads a request's JSON only to find its prompt
(`routing.prompt_key`), lets the policy (`routing.CacheAwarePolicy` by default) pick the
instance most likely to hold that prompt's prefix in its KV cache, and forwards the body as it
came, streaming the answer back byte for byte (SSE included). A client that hangs up closes the
upstream connection, so the instance aborts the request and frees its blocks. /v1/models (and
/v1/models/{model}), /version, /tokenize and /detokenize go to any healthy instance, with the
client's headers (its API key): all of them answer those alike. Any other path is a 404 in
OpenAI's shape, as `kvflow serve` answers it.

Failures: an instance that refuses the connection is marked down and the request is retried on
another one (nothing was sent, so it is safe); so is one it answered with a 503 `overloaded` or
`draining` (nothing was computed; SGLang's router retries these too). A draining instance is
routed around until its /health answers 200 again; if all refuse, the client gets the last
refusal. Nothing else is retried (a 4xx or 500 is the client's answer). An instance that dies
mid-answer ends a stream with an OpenAI-shaped error event and `[DONE]` (tokens already sent
cannot be taken back), and a non-streaming request with a 502 in OpenAI's shape. A health loop
polls every instance's /health and brings it back when it answers again. /health is 200 while
at least one instance is up (its body lists each one's state, and why a --prefill instance that
is up is not used: it is not a KV producer, which is also logged once), 503 when none is;
/metrics is every instance's own metrics, each sample labelled with its `instance`, plus the
router's counters (router_metrics.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvflow.entrypoints.cli_args import UVICORN_LOG_LEVELS
from kvflow.entrypoints.openai.errors import add_error_handlers, error_response
from kvflow.entrypoints.router_metrics import aggregate_metrics
from kvflow.entrypoints.routing import (POLICIES, REFUSALS, Instance, instance_url, producer_info, prompt_key,
                                       prompt_namespace, refusal_code)

try:
    import httpx
except ImportError:  # the openai client may ship its HTTP stack as `httpx2`
    import httpx2 as httpx  # type: ignore[no-redef]

logger = logging.getLogger("kvflow")
HEALTH_INTERVAL_S = 1.0
_FORWARD_HEADERS = ("authorization", "content-type")


def forward_headers(raw: Request) -> dict[str, str]:
    """The client's headers an instance needs (its API key, the body's type); no others, so
    hop-by-hop ones (Host, Content-Length, Connection) are httpx's to set."""
    return {k: v for k, v in raw.headers.items() if k.lower() in _FORWARD_HEADERS}


class Router:
    """The instances, the policy and the forwarding; `build_router_app` puts routes on it."""

    def __init__(self, urls: list[str], policy: str = "cache_aware", request_timeout: float = 600.0,
                 prefill_urls: list[str] | tuple = (), prefill_timeout: float = 60.0) -> None:
        if not urls:
            raise ValueError("router: give at least one instance (--instance URL, or --decode URL)")
        if policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.instances = [Instance(instance_url(u, "--instance/--decode")) for u in urls]
        self.prefills = [Instance(instance_url(u, "--prefill")) for u in prefill_urls]
        self.policy, self.prefill_policy = POLICIES[policy](), POLICIES[policy]()
        self.prefill_timeout = prefill_timeout
        self.disaggregated = {"remote_prefill": 0, "fallback": 0}
        self._prefills_running: set[asyncio.Task] = set()  # the background prefills (kept from the GC)
        self.timeout = httpx.Timeout(request_timeout, connect=5.0)
        self.client: httpx.AsyncClient | None = None
        self.routed = {"cache": 0, "balance": 0, "load": 0, "round_robin": 0}
        self.refused = dict.fromkeys(REFUSALS, 0)

    def healthy(self, pool: list[Instance] | None = None) -> list[Instance]:
        return [i for i in (self.instances if pool is None else pool) if i.healthy]

    def role(self, inst: Instance) -> str:
        return "prefill" if inst in self.prefills else "decode" if self.prefills else "instance"

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=None))
        await self.check_health()

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def check_health(self) -> None:
        async def one(inst: Instance) -> None:
            try:
                ok = (await self.client.get(inst.url + "/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok != inst.healthy:
                logger.warning("router: instance %s is %s", inst.url, "up" if ok else "down")
            if ok:
                inst.healthy = True
                if inst in self.prefills and inst.kv_addr is None:
                    await self.check_producer(inst)
            else:
                inst.mark_down()

        await asyncio.gather(*(one(i) for i in self.instances + self.prefills))

    async def check_producer(self, inst: Instance) -> None:
        """Learn a prefill instance's KV block address (`routing.producer_info`). One that is up but
        not a KV producer would be passed over on every request without a word: say why, once
        (and in /health, `problem`)."""
        try:
            r = await self.client.get(inst.url + "/kv_transfer", timeout=2.0)
        except httpx.HTTPError:
            return  # asked again on the next poll
        inst.kv_addr, problem = producer_info(r.status_code, r.content)
        if problem is not None and problem != inst.problem:
            logger.warning("router: --prefill %s is not a KV producer (%s), so the decode instances compute every "
                           "prompt themselves; start it with --kv-transfer-config '{\"kv_role\": \"kv_producer\"}'",
                           inst.url, problem)
        inst.problem = problem

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            with contextlib.suppress(Exception):
                await self.check_health()

    # ---- forwarding ----------------------------------------------------------------------------
    async def forward(self, path: str, raw: Request) -> Response:
        body_bytes = await raw.body()
        try:
            body = json.loads(body_bytes)
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        key, namespace = prompt_key(path, body), prompt_namespace(body)
        headers = forward_headers(raw)
        # An embedding is all prompt: nothing to hand over. A salted prompt's blocks are keyed by its
        # salt on each instance, which the KV transfer does not carry yet: the decode instance computes it.
        if self.prefills and not path.endswith("embeddings") and body.get("cache_salt") is None:
            body_bytes = await self.prefill(path, body, body_bytes, key, namespace, headers)
        tried: set[str] = set()
        refused: Response | None = None  # the last refusal: the answer if every instance refuses
        while True:
            candidates = [i for i in self.healthy() if i.url not in tried]
            if refused is not None and not candidates:
                return refused
            if not candidates:
                return error_response(503, "no kvflow instance is available behind this router "
                                           f"({len(self.instances)} configured, all down)", "server_error",
                                      code="no_instance")
            choice = self.policy.choose(candidates, key, namespace)
            inst = choice.instance
            tried.add(inst.url)
            request = self.client.build_request("POST", inst.url + path, content=body_bytes, headers=headers)
            inst.in_flight += 1
            try:
                upstream = await self.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing reached it: retry elsewhere
                inst.in_flight -= 1
                inst.failures_total += 1
                logger.warning("router: %s refused the connection (%s); trying another instance", inst.url, exc)
                inst.mark_down()
                continue
            except httpx.HTTPError as exc:
                inst.in_flight -= 1
                inst.failures_total += 1
                return error_response(502, f"the instance {inst.url} failed: {exc!r}", "server_error",
                                      code="instance_failed")
            if upstream.status_code == 503:  # read whole (it is short): a refusal goes to another instance
                answer = await self._relay(inst, upstream, streaming=False)
                if self._refused(inst, answer.status_code, answer.body):
                    inst.index.remove(choice.added)  # it computed nothing: its cache holds none of it
                    refused = answer
                    continue
            else:
                answer = await self._relay(inst, upstream, bool(body.get("stream")))
            inst.requests_total += 1
            self.routed[choice.reason] += 1
            return answer

    def _refused(self, inst: Instance, status: int, body: bytes) -> bool:
        """Whether an answer is a refusal that computed nothing (`routing.refusal_code`), counted. A
        draining instance is taken out of the routing until its /health answers 200 again (while
        draining it answers 503 there too)."""
        code = refusal_code(status, body)
        if code is None:
            return False
        self.refused[code] += 1
        if code == "draining" and inst.healthy:
            logger.warning("router: %s is draining; routing around it until its /health answers 200", inst.url)
            inst.mark_down()
        return True

    async def prefill(self, path: str, body: dict, body_bytes: bytes, key: Any, namespace: str,
                      headers: dict) -> bytes:
        """Start the prompt's prefill on a prefill instance; the body the decode instance gets, at once.

        The prefill runs as the same request cut to one token, in the background: the decode body
        names the producer, and the decode instance subscribes to the prompt's blocks there and
        loads them as each prefill step completes some, so the transfer overlaps the prefill. If no
        prefill instance is up, the decode instance gets the request as it came; if the prefill
        fails or times out, the producer (or its silence) tells the decode instance, which computes
        the rest of the prompt itself.
        """
        candidates = [i for i in self.healthy(self.prefills) if i.kv_addr]
        if not candidates:
            self.disaggregated["fallback"] += 1
            return body_bytes
        inst = self.prefill_policy.choose(candidates, key, namespace).instance
        short = {**body, "max_tokens": 1, "stream": False, "n": 1, "min_tokens": 0, "echo": False,
                 "kv_transfer_params": {"do_remote_decode": True}}
        for name in ("stream_options", "max_completion_tokens", "logprobs", "top_logprobs", "prompt_logprobs"):
            short.pop(name, None)
        task = asyncio.ensure_future(self._run_prefill(inst, path, short, headers))
        self._prefills_running.add(task)
        task.add_done_callback(self._prefills_running.discard)
        return json.dumps({**body, "kv_transfer_params": {"do_remote_prefill": True,
                                                          "remote_kv_addr": inst.kv_addr}}).encode()

    async def _run_prefill(self, inst: Instance, path: str, short: dict, headers: dict) -> None:
        inst.in_flight += 1
        try:
            r = await self.client.post(inst.url + path, json=short, headers=headers, timeout=self.prefill_timeout)
            ok = r.status_code == 200
            # The decode instance already waits on this producer: a refusal cannot go elsewhere now.
            # A draining producer is left out of the next requests' choice, though.
            answered = not self._refused(inst, r.status_code, r.content)
            if not ok:
                logger.warning("router: prefill on %s answered %d: %s", inst.url, r.status_code, r.text[:200])
        except httpx.HTTPError as exc:
            logger.warning("router: prefill on %s failed (%r); the decode instance computes the prompt", inst.url, exc)
            inst.failures_total += 1
            ok = answered = False
        finally:
            inst.in_flight -= 1
        if answered:
            inst.requests_total += 1
        self.disaggregated["remote_prefill" if ok else "fallback"] += 1

    async def _relay(self, inst: Instance, upstream: httpx.Response, streaming: bool) -> Response:
        passed = {k: v for k, v in upstream.headers.items()
                  if k.lower() in ("content-type", "retry-after", "cache-control", "x-accel-buffering")}
        if not streaming or upstream.status_code != 200:
            try:
                content = await upstream.aread()
            except httpx.HTTPError as exc:
                inst.failures_total += 1
                return error_response(502, f"the instance {inst.url} failed mid-answer: {exc!r}", "server_error",
                                      code="instance_failed")
            finally:
                await upstream.aclose()
                inst.in_flight -= 1
            return Response(content, status_code=upstream.status_code, headers=passed)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                inst.failures_total += 1
                err = {"error": {"message": f"the instance {inst.url} failed mid-stream: {exc!r}",
                                 "type": "server_error", "param": None, "code": "instance_failed"}}
                yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                await upstream.aclose()  # the client left, or the answer ended: the instance aborts or is done
                inst.in_flight -= 1

        return _ClosingStreamingResponse(body(), status_code=200, headers=passed)

    async def to_any(self, path: str, raw: Request) -> Response:
        """The first healthy instance's answer to `raw` (a GET, or the tokenizer's POSTs: requests
        every instance answers alike), sent with the client's headers as `forward` sends them. An
        instance that cannot be reached or refuses (draining, overloaded) passes it on."""
        headers = forward_headers(raw)
        content = await raw.body() if raw.method == "POST" else None
        refused: Response | None = None
        for inst in self.healthy():
            try:
                r = await self.client.request(raw.method, inst.url + path, content=content, headers=headers)
            except httpx.HTTPError:
                continue
            answer = Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"),
                              headers={k: v for k, v in r.headers.items() if k.lower() == "retry-after"})
            if not self._refused(inst, r.status_code, r.content):
                return answer
            refused = answer
        return refused or error_response(503, "no kvflow instance is available behind this router", "server_error",
                                         code="no_instance")

    async def metrics(self) -> str:
        async def one(inst: Instance) -> str:
            if not inst.healthy:
                return ""
            try:
                return (await self.client.get(inst.url + "/metrics", timeout=5.0)).text
            except httpx.HTTPError:
                return ""

        pool = self.instances + self.prefills
        texts = await asyncio.gather(*(one(i) for i in pool))
        return aggregate_metrics([(i.url, t) for i, t in zip(pool, texts)], self)


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its generator however the response ends (the client left: the upstream closes now)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def build_router_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        task = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await router.stop()

    app = FastAPI(title="kvflow router", lifespan=lifespan)
    app.state.router = router
    add_error_handlers(app)  # an unknown path or method: OpenAI's error shape, as kvflow serve answers

    def post_route(path: str, send: Callable[[str, Request], Awaitable[Response]]) -> None:
        async def route(raw: Request) -> Response:
            return await send(path, raw)
        app.add_api_route(path, route, methods=["POST"])

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):  # routed by the policy
        post_route(path, router.forward)
    for path in ("/tokenize", "/detokenize"):  # any instance answers these alike
        post_route(path, router.to_any)

    async def to_any(raw: Request) -> Response:
        return await router.to_any(raw.url.path + (f"?{raw.url.query}" if raw.url.query else ""), raw)

    for path in ("/v1/models", "/v1/models/{model_id:path}", "/version"):  # any instance answers these alike
        app.add_api_route(path, to_any, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        pool = router.instances + router.prefills
        states = [{"url": i.url, "healthy": i.healthy, "in_flight": i.in_flight, "role": router.role(i),
                   **({"problem": i.problem} if i.problem else {})} for i in pool]
        if not router.healthy():
            return error_response(503, "no kvflow instance behind this router is healthy: "
                                  + ", ".join(i.url for i in router.instances), "server_error", code="no_instance")
        status = "ok" if all(i.healthy and not i.problem for i in pool) else "degraded"
        return JSONResponse({"status": status, "instances": states})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics(), media_type="text/plain; version=0.0.4")

    return app


# ---- the command ------------------------------------------------------------------------------
def register_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="one OpenAI address in front of several kvflow serve instances")
    p.add_argument("--instance", "--decode", dest="instances", action="append", default=[], metavar="URL",
                   help="a kvflow serve instance, e.g. http://127.0.0.1:8001 (repeat for each)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill instance (kvflow serve --kv-transfer-config '{\"kv_role\": \"kv_producer\"}'); "
                        "then every --decode instance must be a kv_consumer")
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="seconds a prefill may take before the decode instance computes the prompt itself")
    p.add_argument("--policy", default="cache_aware", choices=sorted(POLICIES),
                   help="cache_aware: the instance holding the longest prefix of the prompt, by load "
                        "otherwise (default); round_robin")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds an instance may take to answer")
    p.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    router = Router(args.instances, args.policy, args.request_timeout, args.prefill, args.prefill_timeout)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # --log-level debug keeps them
        for name in ("httpx", "httpcore", "httpx2", "httpcore2"):  # INFO: a line per instance per health poll
            logging.getLogger(name).setLevel(logging.WARNING)
    logger.info("router: %s over %s%s on http://%s:%d", router.policy.name, ", ".join(args.instances),
                f" (prefill on {', '.join(args.prefill)})" if args.prefill else "", args.host, args.port)
    uvicorn.run(build_router_app(router), host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
