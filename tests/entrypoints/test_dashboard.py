"""`/dashboard` and its event feed on a live server (the default model).

Guards: the page is one self-contained file (no external script, style or font: it must work
with no internet); each frame's block states add up to the pool and agree with the engine's
free-block count; while a request runs, the frame lists it and colours exactly its blocks;
frames carry the recent-latency series; a client that leaves stops the feed. The headless
browser test is in test_dashboard_browser.py.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time

import numpy as np

from kvflow.entrypoints.openai.dashboard import MIN_INTERVAL_S
from tests.entrypoints.conftest import API_KEY, httpx


def read_frames(base_url: str, count: int, interval: float = 0.1) -> list[dict]:
    frames = []
    params = {"interval": interval, "frames": count, "key": API_KEY}
    with httpx.stream("GET", f"{base_url}/dashboard/events", params=params, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                frames.append(json.loads(line[len("data: "):]))
    return frames


def decode(frame: dict) -> tuple[np.ndarray, np.ndarray]:
    pool = frame["pool"]
    states = np.frombuffer(base64.b64decode(pool["states"]), dtype=np.uint8)
    owners = np.frombuffer(base64.b64decode(pool["owners"]), dtype="<u2")
    return states, owners


def test_page_and_feed_need_the_api_key(live_server):
    for path in ("/dashboard", "/dashboard/events?frames=1"):
        refused = httpx.get(f"{live_server.base_url}{path}", timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(f"{live_server.base_url}{path}", params={"key": "nope"}, timeout=30)
        assert wrong.status_code == 401
    by_header = httpx.get(f"{live_server.base_url}/dashboard", headers=live_server.headers, timeout=30)
    assert by_header.status_code == 200


def test_page_is_self_contained(live_server):
    page = httpx.get(f"{live_server.base_url}/dashboard", params={"key": API_KEY}, timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "<canvas" in html and "dashboard/events" in html
    # nothing fetched from elsewhere: no src/href to another host, no @import, no CDN
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "external resource in the page"
    assert "@import" not in html and "cdn" not in html.lower()


def test_idle_frame_matches_the_engine(live_server):
    assert live_server.wait_pool_free(10)
    (frame,) = read_frames(live_server.base_url, 1)
    states, owners = decode(frame)
    stats = live_server.engine.get_stats()
    counts = frame["pool"]["counts"]
    assert len(states) == len(owners) == frame["pool"]["num_blocks"] == stats.num_blocks
    assert counts == {"free": int((states == 0).sum()), "cached": int((states == 1).sum()),
                      "in_use": int((states == 2).sum()), "shared": int((states == 3).sum())}
    assert counts["free"] + counts["cached"] == stats.num_free_blocks == frame["stats"]["num_free_blocks"]
    assert counts["in_use"] == counts["shared"] == 0 and not owners.any() and frame["requests"] == []
    assert frame["model"] == live_server.model
    assert len(frame["latency"]["ttft_p50"]) == len(frame["latency"]["tokens_per_s"]) == 60


def test_running_request_is_listed_with_its_blocks(live_server):
    done = threading.Event()

    def generate() -> None:
        httpx.post(f"{live_server.v1}/completions", headers=live_server.headers, timeout=300,
                   json={"model": live_server.model, "prompt": "Count slowly from one to one hundred: one, two,",
                         "max_tokens": 160, "temperature": 0, "ignore_eos": True})
        done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        seen = None
        for frame in read_frames(live_server.base_url, 40, interval=0.1):
            # (a snapshot taken between the add and the step that schedules it lists it waiting)
            if frame["requests"] and frame["requests"][0]["status"] == "running":
                seen = frame
                break
        assert seen is not None, "no frame showed the running request"
        states, owners = decode(seen)
        (request,) = seen["requests"]
        assert request["status"] == "running" and request["num_prompt_tokens"] > 5
        held = int(((states == 2) | (states == 3)).sum())
        assert request["num_blocks"] == held == int((owners == 1).sum()) >= 1
        assert seen["stats"]["num_running"] == 1
    finally:
        worker.join(300)
    assert done.is_set() and live_server.wait_pool_free(10)
    # read_frames took its 40 frames over ~4 s: on a slow machine the request can end just after
    # the last one, whose snapshot pages share for MIN_INTERVAL_S. Ask once that has passed.
    time.sleep(2 * MIN_INTERVAL_S)
    (after,) = read_frames(live_server.base_url, 1)
    assert after["stats"]["generation_tokens"] >= 160 and any(x > 0 for x in after["latency"]["tokens_per_s"])
    assert any(x is not None for x in after["latency"]["ttft_p50"])
