"""The dashboard in a real headless Chromium (Debian's `chromium`; `make test` installs it where
it can, and these tests skip with the reason where it cannot).

Guards: the page loads and its script runs (frames arrive over SSE and the grid is drawn);
the cells it drew add up to the pool and, while a request runs, the drawn in-use cells match
the block counts `/metrics` reports; a screenshot is kept as a test artifact
(bench-results/dashboard.png).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.entrypoints.conftest import httpx

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (Debian: apt-get install "
                                                         "chromium; make test installs it where it can)")
ARTIFACTS = Path(__file__).resolve().parents[2] / "bench-results"


def chromium(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Waits for 10 s of the page's virtual time: the URLs below ask for a bounded number of
    frames, after which the page closes its event stream and virtual time can run out."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--hide-scrollbars", "--virtual-time-budget=10000"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=timeout)


class _Drawn(HTMLParser):
    """The attributes of <div id="drawn">, where the page counts the cells it drew."""

    def __init__(self) -> None:
        super().__init__()
        self.attrs: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id") == "drawn":
            self.attrs = {k: v for k, v in attrs.items() if k.startswith("data-")}


def drawn_counts(dom: str) -> dict[str, int]:
    parser = _Drawn()
    parser.feed(dom)
    return {k.removeprefix("data-"): int(v) for k, v in parser.attrs.items()}


def used_blocks_from_metrics(base_url: str, num_blocks: int) -> int:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    usage = float(re.search(r"^kvflow:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M).group(1))
    return round(usage * num_blocks)


def test_page_draws_the_pool_while_a_request_runs(live_server, tmp_path):
    num_blocks = live_server.engine.get_stats().num_blocks
    url = f"{live_server.base_url}/dashboard?interval=0.2&frames=5&key={live_server.api_key}"
    started, stop = threading.Event(), threading.Event()

    def generate() -> None:  # a long request, so that blocks are held while the page draws
        with httpx.stream("POST", f"{live_server.v1}/completions", headers=live_server.headers, timeout=600,
                          json={"model": live_server.model, "prompt": "Write a long story about a lighthouse.",
                                "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    return

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        assert started.wait(120), "the request never started streaming"
        used_before = used_blocks_from_metrics(live_server.base_url, num_blocks)
        result = chromium("--dump-dom", url)
        used_after = used_blocks_from_metrics(live_server.base_url, num_blocks)
        assert result.returncode == 0, result.stderr[-2000:]
        drawn = drawn_counts(result.stdout)
        assert drawn.get("frames", 0) >= 1, f"the page drew no frame: {result.stdout[:500]}"
        assert drawn["blocks"] == num_blocks
        assert drawn["free"] + drawn["cached"] + drawn["in-use"] + drawn["shared"] == num_blocks
        # The drawn cells agree exactly with the frame's own free-block count, and with the
        # server's /metrics scraped before and after the page (the request only grows meanwhile:
        # a block every 16 tokens; +-1 for the usage gauge's rounding).
        held = drawn["in-use"] + drawn["shared"]
        assert held >= 1 and held == num_blocks - drawn["stats-free"], drawn
        assert used_before - 1 <= held <= used_after + 1, (drawn, used_before, used_after)

        shot = tmp_path / "dashboard.png"
        result = chromium("--window-size=1280,1000", f"--screenshot={shot}", url)
        assert result.returncode == 0 and shot.exists() and shot.stat().st_size > 10_000, result.stderr[-2000:]
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copy(shot, ARTIFACTS / "dashboard.png")
    finally:
        stop.set()
        worker.join(600)
    assert live_server.wait_pool_free(30)
