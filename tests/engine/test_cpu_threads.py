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


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity mask on this OS")
def test_usable_cpus_follows_the_affinity_mask():
    assert usable_cpus() == len(os.sched_getaffinity(0))


def test_the_thread_count_is_set_on_the_calling_thread_only():
    seen: dict[str, int] = {}
    before = torch.get_num_threads()

    def worker() -> None:
        seen["set"] = set_compute_threads(usable_cpus() + 1)
        seen["after"] = torch.get_num_threads()
        set_compute_threads(before)  # torch also keeps the last count as the default for new threads

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["set"] == seen["after"] == usable_cpus() + 1
    assert torch.get_num_threads() == before  # this thread's setting is its own


@linux_only
def test_release_ends_the_calling_threads_openmp_workers():
    out = run_python(
        "import os, time, torch\n"
        "from kvflow.engine.cpu_threads import release_openmp_threads\n"
        "tasks = lambda: len(os.listdir('/proc/self/task'))\n"
        "torch.set_num_threads(2)\n"
        "before = tasks()\n"
        "torch.randn(512, 512) @ torch.randn(512, 512)  # a parallel region: this thread's team starts\n"
        "with_team = tasks()\n"
        "released = release_openmp_threads()\n"
        "deadline = time.time() + 10  # the worker is told to end; it leaves /proc a moment later\n"
        "while tasks() > before and time.time() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print(before, with_team, tasks(), released)\n")
    before, with_team, after, released = out.split()
    assert int(with_team) == int(before) + 1  # the team's one worker besides this thread
    assert released == "True" and int(after) == int(before)


def test_maps_lines_give_whole_paths_of_openmp_runtimes():
    from kvflow.engine.cpu_threads import _OPENMP_LIBRARIES, _mapped_path

    line = "7f00-7f01 r-xp 00000000 08:01 123   /opt/my libs/libgomp-a34b3233.so.1 (deleted)\n"
    assert _mapped_path(line) == "/opt/my libs/libgomp-a34b3233.so.1"  # spaces kept, the mark dropped
    assert _mapped_path("7f00-7f01 rw-p 00000000 00:00 0 \n") == ""  # anonymous memory
    assert _mapped_path("7ffd-7ffe rw-p 00000000 00:00 0   [stack]\n") == ""
    names = ["libgomp.so.1", "libomp.so", "libomp-6d5e1c2b.so", "libiomp5.so", "libomptarget.so"]
    assert [n.startswith(_OPENMP_LIBRARIES) for n in names] == [True, True, True, True, False]
