"""A flood at ten times the sustainable request rate: refuse the excess cleanly, serve the rest exactly.

A server with a small batch (max_num_seqs 4) and a small admission queue (max_waiting 4)
first measures how many requests a second it completes with a full batch, then receives
ten times that rate for a few seconds (streaming and not, some clients leaving mid-stream).
What must hold: every answer is either a 200 whose greedy text equals the same prompt run
alone, or a 503 with Retry-After in OpenAI's error shape; the engine never queues more than
it was allowed; memory stays flat; and afterwards every KV block is back in the pool.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from dataclasses import dataclass

import pytest

from kvflow.config import EngineConfig
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.openai.server import build_app

from .conftest import MODEL_NAME, httpx, serving, wait_engine_idle
from .test_server import _samples

MAX_NUM_SEQS, MAX_WAITING, MAX_TOKENS = 4, 4, 8
FLOOD_S, MAX_FLOOD_REQUESTS = 5.0, 300
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List the days of the week:", "Water boils at",
           "My favourite colour is", "The quick brown fox"]
RSS_BOUND = 256 << 20  # generous: the flood's requests must not stay behind, nothing finer


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@dataclass
class Outcome:
    prompt: int
    status: int
    text: str | None = None
    finish_reason: str | None = None
    error: dict | None = None
    retry_after: str | None = None
    left: bool = False  # the client hung up mid-stream on purpose


@pytest.fixture(scope="module")
def flood_server():
    config = EngineConfig(dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, max_num_seqs=MAX_NUM_SEQS,
                          seed=0)
    engine = AsyncEngine.from_config(config, max_waiting=MAX_WAITING)
    try:
        with serving(build_app(engine, MODEL_NAME)) as port:
            yield f"http://127.0.0.1:{port}", engine
    finally:
        engine.shutdown()


def request_body(i: int, stream: bool) -> dict:
    return {"model": MODEL_NAME, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}


async def send(client: httpx.AsyncClient, i: int, stream: bool, leave: bool = False) -> Outcome:
    body = request_body(i, stream)
    if not stream:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return Outcome(i % len(PROMPTS), r.status_code, error=r.json().get("error"),
                           retry_after=r.headers.get("retry-after"))
        choice = r.json()["choices"][0]
        return Outcome(i % len(PROMPTS), 200, choice["text"], choice["finish_reason"])
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Outcome(i % len(PROMPTS), r.status_code, error=r.json().get("error"),
                           retry_after=r.headers.get("retry-after"))
        text, finish = "", None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if leave:
                return Outcome(i % len(PROMPTS), 200, left=True)  # closing the stream hangs up
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            finish = event["choices"][0]["finish_reason"] or finish
        return Outcome(i % len(PROMPTS), 200, text, finish)


def test_a_burst_that_fits_the_free_slots_and_the_queue_is_served(flood_server):
    """max_waiting counts the requests waiting for a batch slot: into an idle engine, a burst of
    max_num_seqs + max_waiting requests is served whole (the free slots took 503s before)."""
    base_url, engine = flood_server
    assert wait_engine_idle(engine, 60)

    async def burst() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            return await asyncio.gather(*(send(client, i, stream=False) for i in range(MAX_NUM_SEQS + MAX_WAITING)))

    outcomes = asyncio.run(burst())
    assert [o.status for o in outcomes] == [200] * (MAX_NUM_SEQS + MAX_WAITING), outcomes


def test_flood_refuses_the_excess_and_serves_the_rest_exactly(flood_server):
    base_url, engine = flood_server

    async def run() -> tuple[dict[int, str], float, list[Outcome], int, int, int]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
            alone = {}
            for i in range(len(PROMPTS)):  # references, one request at a time
                out = await send(client, i, stream=False)
                assert out.status == 200, out
                alone[i] = out.text
            # The sustainable rate: full batches back to back.
            started, batch = time.monotonic(), []
            for _ in range(2):
                batch += await asyncio.gather(*(send(client, i, stream=False) for i in range(MAX_NUM_SEQS)))
            rate = len(batch) / (time.monotonic() - started)
            assert all(o.status == 200 and o.text == alone[o.prompt] for o in batch), batch
            gc.collect()
            rss_before = rss_bytes()

            interval = 1.0 / (10 * rate)
            count = min(MAX_FLOOD_REQUESTS, int(FLOOD_S / interval))
            tasks, max_waiting_seen = [], 0
            for i in range(count):
                tasks.append(asyncio.ensure_future(send(client, i, stream=i % 3 == 0, leave=i % 9 == 0)))
                stats = engine.get_stats()  # waiting for a slot: beyond the batch's free ones
                max_waiting_seen = max(max_waiting_seen,
                                       stats.num_waiting - max(0, MAX_NUM_SEQS - stats.num_running))
                await asyncio.sleep(interval)
            outcomes = await asyncio.gather(*tasks)
        gc.collect()
        return alone, rate, outcomes, rss_before, rss_bytes(), max_waiting_seen

    alone, rate, outcomes, rss_before, rss_after, max_waiting_seen = asyncio.run(run())
    served = [o for o in outcomes if o.status == 200 and not o.left]
    refused = [o for o in outcomes if o.status != 200]
    print(f"sustainable {rate:.1f} req/s; flood of {len(outcomes)} at ~{10 * rate:.0f} req/s: {len(served)} served, "
          f"{len(refused)} refused, {sum(o.left for o in outcomes)} left mid-stream; "
          f"RSS {rss_before >> 20} -> {rss_after >> 20} MiB")
    assert refused and len(served) >= MAX_NUM_SEQS, (len(refused), len(served))
    for o in refused:
        assert o.status == 503 and o.retry_after is not None and int(o.retry_after) >= 1, o
        assert set(o.error) == {"message", "type", "param", "code"} and o.error["code"] == "overloaded", o
    for o in served:  # greedy: the same tokens as the prompt alone, whatever the batch around it
        assert o.text == alone[o.prompt] and o.finish_reason == "length", o
    assert max_waiting_seen <= MAX_WAITING
    assert rss_after - rss_before < RSS_BOUND, (rss_before >> 20, rss_after >> 20)

    assert wait_engine_idle(engine, 30), engine.get_stats()  # aborted streams too: every block is free
    engine.engine.check_integrity()
    metrics = _samples(httpx.get(base_url + "/metrics", timeout=30).text)
    assert metrics["kvflow:kv_cache_usage_perc"] == 0 and metrics["kvflow:num_requests_running"] == 0
    assert metrics["kvflow:num_requests_waiting"] == 0
