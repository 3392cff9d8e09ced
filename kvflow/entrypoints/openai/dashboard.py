"""`/dashboard`: a live view of the KV block pool, served by `kvflow serve` itself.

The page (static/dashboard.html, one file: no CDN, no build step, works offline) draws the
pool as a grid, one cell per block, coloured free / cached (evictable) / in use by request /
shared; lists the running and waiting requests; and charts TTFT, ITL and generated tokens per
second over the last five minutes, with the prefix-cache hit rate and preemptions.

Updates arrive over server-sent events from `/dashboard/events`, one frame per `interval`
seconds per open page. A frame costs the engine one pool snapshot taken on its own thread
between two steps (`AsyncEngine.call` + `engine/pool_snapshot.py`: a pass over the block
records, no KV data), so the cost is bounded by the frame rate and the number of open pages,
not by the traffic. Block states and owners travel as base64 arrays: a few KB per frame for
thousands of blocks.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from importlib import resources
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from kvflow.engine.pool_snapshot import PoolSnapshot, take_snapshot
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.openai.metrics import ServerMetrics

MIN_INTERVAL_S = 0.1


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


def register_dashboard(app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics, model_name: str) -> None:
    """Add `/dashboard` (the page) and `/dashboard/events` (its SSE feed) to `app`."""
    page = resources.files("kvflow.entrypoints.openai").joinpath("static/dashboard.html").read_text("utf-8")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(raw: Request, interval: float = 0.5, frames: int = 0) -> StreamingResponse:
        """`interval` seconds between frames (at least 0.1); `frames` > 0 stops after that many."""
        interval = max(MIN_INTERVAL_S, interval)

        async def events() -> AsyncIterator[str]:
            sent = 0
            while not await raw.is_disconnected():
                try:
                    snapshot, stats = await engine.call(_snapshot)
                except Exception as exc:  # the engine is down: say so, and end the feed
                    yield f"event: error\ndata: {json.dumps({'message': str(exc)})}\n\n"
                    return
                payload = frame(snapshot, stats, metrics, model_name, time.time())
                yield f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
                sent += 1
                if frames and sent >= frames:
                    return
                await asyncio.sleep(interval)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
