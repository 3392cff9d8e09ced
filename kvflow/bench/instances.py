"""`kvflow serve` instances that a bench starts on loopback ports and waits for (`kvflow bench
router`, `kvflow bench disagg`): one way to launch them and to know when they answer."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from kvflow.bench.serve_client import httpx

Instance = tuple[subprocess.Popen, str]  # the process and its base URL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(serve_args: list[str], kv_transfer: dict | None = None, cpus: str | None = None,
                threads: int | None = None) -> Instance:
    """One `kvflow serve` on a free port, its output discarded; `kv_transfer` is its
    --kv-transfer-config, `cpus` a taskset list."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--port", str(port),
           "--uvicorn-log-level", "warning", "--served-model-name", "bench",
           *(["--num-threads", str(threads)] if threads is not None else []), *serve_args,
           *(["--kv-transfer-config", json.dumps(kv_transfer)] if kv_transfer is not None else [])]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}"


def wait_healthy(instances: list[Instance], timeout: float) -> None:
    """Until every instance's /health answers 200; an instance that exits or is not up within
    `timeout` seconds raises, naming its URL."""
    deadline = time.monotonic() + timeout
    for proc, url in instances:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvflow serve {url} exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvflow serve {url} did not start within {timeout:g} s")
            time.sleep(0.5)
