"""The engine's CPU thread settings (kvflow/engine/cpu_threads.py), checked in fresh interpreters:
an OpenMP worker team lives as long as its thread, so only a new process shows a clean slate."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvflow.engine.cpu_threads import set_compute_threads, usable_cpus

ROOT = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)")


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_usable_cpus_follows_the_affinity_mask():
    assert usable_cpus() == len(os.sched_getaffinity(0))


def test_the_thread_count_is_set_on_the_calling_thread_only():
    seen: dict[str, int] = {}
    before = torch.get_num_threads()

    def worker() -> None:
        seen["set"] = set_compute_threads(usable_cpus() + 1)
        seen["after"] = torch.get_num_threads()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["set"] == seen["after"] == usable_cpus() + 1
    assert torch.get_num_threads() == before  # this thread's setting is its own


@linux_only
def test_release_ends_the_calling_threads_openmp_workers():
    out = run_python(
        "import os, torch\n"
        "from kvflow.engine.cpu_threads import release_openmp_threads\n"
        "tasks = lambda: len(os.listdir('/proc/self/task'))\n"
        "torch.set_num_threads(2)\n"
        "before = tasks()\n"
        "torch.randn(512, 512) @ torch.randn(512, 512)  # a parallel region: this thread's team starts\n"
        "with_team = tasks()\n"
        "released = release_openmp_threads()\n"
        "print(before, with_team, tasks(), released)\n")
    before, with_team, after, released = out.split()
    assert int(with_team) == int(before) + 1  # the team's one worker besides this thread
    assert released == "True" and int(after) == int(before)
