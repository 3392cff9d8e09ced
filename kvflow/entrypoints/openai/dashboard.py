"""`/dashboard`: a live view of the KV block pool, served by `kvflow serve` itself.

The page (static/dashboard.html, one file: no CDN, no build step, works offline) draws the
pool as a grid, one cell per block, coloured free / cached (evictable) / in use by request /
shared; lists the running and waiting requests; and charts TTFT, ITL and generated tokens per
second over the last five minutes, with the prefix-cache hit rate and preemptions.

Updates arrive over server-sent events from `/dashboard/events`, one frame per `interval`
seconds per open page. A frame costs the engine one pool snapshot taken on its own thread
between two steps (`AsyncEngine.call` + `engine/pool_snapshot.py`: a pass over the block
records, no KV data). Pages share a snapshot younger than `MIN_INTERVAL_S`, and at most
`MAX_FEEDS` feeds run at once (503 beyond), so the engine's cost is bounded whatever the
number of viewers. Block states and owners travel as base64 arrays: a few KB per frame for
thousands of blocks. With `--api-key` the page and its feed need the key too, as `?key=` (an
EventSource cannot send headers) or a bearer header. A draining server ends every feed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from importlib import resources
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from kvflow.engine.pool_snapshot import PoolSnapshot, take_snapshot
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.openai.errors import error_response
from kvflow.entrypoints.openai.metrics import ServerMetrics

MIN_INTERVAL_S = 0.1
MAX_FEEDS = 8


def _snapshot(engine) -> tuple[PoolSnapshot, Any]:
    """On the engine thread: the pool and the engine's counters at the same instant."""
    sched = engine.scheduler
    return take_snapshot(engine.kv_cache_manager, list(sched.running), list(sched.waiting)), engine.get_stats()


def frame(snapshot: PoolSnapshot, stats: Any, metrics: ServerMetrics, model_name: str, now: float) -> dict:
    """One update for the page: JSON-ready."""
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    return {
        "time": now,
        "model": model_name,
        "pool": {
            "num_blocks": snapshot.num_blocks,
            "block_size": snapshot.block_size,
            "states": base64.b64encode(snapshot.states.tobytes()).decode(),
            "owners": base64.b64encode(snapshot.owners.astype("<u2").tobytes()).decode(),
            "counts": snapshot.counts(),
        },
        "requests": [vars(r) for r in snapshot.requests],
        "stats": {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_free_blocks": stats.num_free_blocks,
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "num_preemptions": stats.num_preemptions,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
        },
        "latency": metrics.recent.series(now),
    }


def register_dashboard(app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics, model_name: str,
                       api_key: str | None = None) -> None:
    """Add `/dashboard` (the page) and `/dashboard/events` (its SSE feed) to `app`."""
    page = resources.files("kvflow.entrypoints.openai").joinpath("static/dashboard.html").read_text("utf-8")
    feeds = 0
    latest: tuple[float, PoolSnapshot, Any] | None = None

    def refused(raw: Request) -> Response | None:
        if not api_key:
            return None
        given = raw.query_params.get("key") or raw.headers.get("authorization", "").removeprefix("Bearer ")
        if secrets.compare_digest(given.encode(), api_key.encode()):
            return None
        return error_response(401, "the dashboard needs the server's API key: open /dashboard?key=...",
                              "invalid_request_error", code="invalid_api_key")

    async def snapshot() -> tuple[PoolSnapshot, Any]:
        nonlocal latest
        now = time.monotonic()
        if latest is None or now - latest[0] >= MIN_INTERVAL_S:  # several pages share one snapshot
            latest = (now, *(await engine.call(_snapshot)))
        return latest[1], latest[2]

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(raw: Request) -> Response:
        return refused(raw) or HTMLResponse(page)

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(raw: Request, interval: float = 0.5, frames: int = 0) -> Response:
        """`interval` seconds between frames (at least 0.1); `frames` > 0 stops after that many."""
        if (denied := refused(raw)) is not None:
            return denied
        if feeds >= MAX_FEEDS:
            return error_response(503, f"{MAX_FEEDS} dashboard feeds are open already; close one and retry",
                                  "server_error", code="overloaded", headers={"Retry-After": "5"})
        interval = max(MIN_INTERVAL_S, interval)
        drain = getattr(raw.app.state, "drain", None)

        async def events() -> AsyncIterator[str]:
            nonlocal feeds
            sent = 0
            feeds += 1
            try:
                while not await raw.is_disconnected():
                    if drain is not None and drain.draining:  # shutting down: let the page know, end the feed
                        yield f"event: error\ndata: {json.dumps({'message': 'the server is draining'})}\n\n"
                        return
                    try:
                        snap, stats = await snapshot()
                    except Exception as exc:  # the engine is down: say so, and end the feed
                        yield f"event: error\ndata: {json.dumps({'message': str(exc)})}\n\n"
                        return
                    payload = frame(snap, stats, metrics, model_name, time.time())
                    yield f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
                    sent += 1
                    if frames and sent >= frames:
                        return
                    await asyncio.sleep(interval)
            finally:
                feeds -= 1

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
