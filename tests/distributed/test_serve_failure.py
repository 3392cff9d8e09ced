"""`kvflow serve -tp 2` whose worker is killed: the request fails, and the server exits 1
instead of answering 503 forever (its /health is 503 from the failure on). The ranks are
children of the engine core process, which is the API server's child."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.entrypoints.conftest import httpx

ROOT = Path(__file__).resolve().parents[2]
BOOT_TIMEOUT_S = 300  # importing torch on a busy machine


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def test_killed_worker_makes_the_server_exit_1(tiny_gqa, tmp_path):
    path, prompts, _ = tiny_gqa
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVFLOW_WORKER_MULTIPROC_METHOD": "fork",
           "KVFLOW_OVERSUBSCRIBE": "1"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--model", path,
                             "--dtype", "float32", "-tp", "2", "--num-threads", "1", "--max-model-len", "128",
                             "--kv-cache-memory", "1MiB", "--port", str(port), "--uvicorn-log-level", "warning"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.3)
        # The ranks are the engine core process's children (the core is the server's child).
        workers = [g for kid in _children(proc.pid) for g in _children(kid)]
        assert len(workers) >= 2, workers
        body = {"model": path, "prompt": prompts[0], "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        for pid in workers:  # every child: both ranks (whichever the driver notices first is named)
            os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code >= 500, r.text
        assert proc.wait(30) == 1, (tmp_path / "serve.log").read_text()[-3000:]
        assert time.monotonic() - started < 30
        assert "worker rank" in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
