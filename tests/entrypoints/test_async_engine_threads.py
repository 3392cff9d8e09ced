"""The engine thread runs the model with the configured thread count, and the thread that built
the engine keeps no OpenMP workers: with both teams alive on a 2-CPU machine libgomp stops its
workers spinning between parallel regions, and `kvflow serve` decoded a stream 4x slower than
`LLM` (kvflow/engine/cpu_threads.py)."""

from __future__ import annotations

import os

import pytest

from kvflow.engine.cpu_threads import usable_cpus

from ..engine.test_cpu_threads import run_python

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)")

PROBE = """
import asyncio, os, sys, torch
from kvflow.config import EngineConfig
from kvflow.engine.cpu_threads import release_openmp_threads
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.sampling.params import SamplingParams

engine = AsyncEngine.from_config(EngineConfig(model=sys.argv[1], dtype="float32", num_threads={threads},
                                              kv_cache_memory=8 << 20))

async def main():
    stream = await engine.add_request("r", {{"prompt_token_ids": [1, 2, 3, 4]}}, SamplingParams(max_tokens=4))
    async for _ in stream:
        pass
    return await engine.call(lambda e: torch.get_num_threads())

engine_thread_threads = asyncio.run(main())
tasks = len(os.listdir("/proc/self/task"))
release_openmp_threads()  # ends this (main) thread's team, if building the engine left one
print(engine_thread_threads, tasks - len(os.listdir("/proc/self/task")))
engine.shutdown()
"""


def test_engine_thread_uses_the_configured_threads_and_the_builder_keeps_no_workers(tiny_models):
    path, _ = tiny_models("llama")
    threads = usable_cpus() + 1  # differs from the default a thread starts with
    code = PROBE.format(threads=threads).replace("sys.argv[1]", repr(path))
    engine_thread_threads, main_workers_left = map(int, run_python(code).split())
    assert engine_thread_threads == threads
    assert main_workers_left == 0
