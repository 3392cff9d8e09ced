"""How many CPU threads the model's parallel regions use, and on which thread they start.

PyTorch's CPU kernels and kvflow's own (`kvflow/csrc`) split their work with OpenMP. Two facts of
the OpenMP runtime that PyTorch ships (GNU libgomp) decide how fast a forward pass runs when the
engine steps on a thread of its own, as `AsyncEngine` (the server) does:

- The thread count is a per-thread OpenMP setting. PyTorch copies its own count into a thread
  at that thread's first parallel torch op, but kvflow's kernels read the thread's setting as it
  stands, so each thread that runs the model calls `set_compute_threads` before its first step.
- Every thread that has started a parallel region keeps its own team of worker threads for the
  life of the thread. Once the workers of all teams outnumber the CPUs, libgomp stops letting
  idle workers spin between regions: each of the hundreds of regions of a forward pass then
  wakes its workers through the kernel. Built on the main thread (loading, the warm-up pass) and
  stepped on the engine thread, the engine had two teams on two CPUs: a single stream decoded
  at 20 ms per token instead of 5 (`kvflow serve`, SmolLM2-135M, 2 cores). `release_openmp_threads`
  ends the calling thread's team once that thread's share of the work is done.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

logger = logging.getLogger("kvflow")
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: end the threads, keep what a later region needs to restart


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: `taskset` counts), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS)
        return max(1, os.cpu_count() or 1)


def set_compute_threads(num_threads: int | None) -> int:
    """Set the calling thread's parallel regions to `num_threads` (None or 0: every usable CPU)."""
    n = num_threads or usable_cpus()
    torch.set_num_threads(n)
    return n


_OPENMP_LIBRARIES = ("libgomp", "libomp.", "libomp-", "libiomp")  # GNU, LLVM (not libomptarget), Intel


def _mapped_path(maps_line: str) -> str:
    """The file of one /proc/self/maps line ('' for anonymous memory); a path may hold spaces,
    and a library replaced on disk since it was loaded is marked ' (deleted)'."""
    fields = maps_line.rstrip("\n").split(maxsplit=5)
    path = fields[5] if len(fields) == 6 else ""
    return path.removesuffix(" (deleted)") if path.startswith("/") else ""


def _openmp_runtimes() -> list[ctypes.CDLL]:
    """The OpenMP runtimes loaded into this process: PyTorch's, and any that another wheel
    bundles (sentencepiece ships its own libgomp copy)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {_mapped_path(line) for line in maps}
    except OSError:
        return []
    paths = {p for p in paths if p and os.path.basename(p).startswith(_OPENMP_LIBRARIES)}
    runtimes = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already mapped: the same handle, no second copy
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            runtimes.append(lib)
    return runtimes


def release_openmp_threads() -> bool:
    """End the calling thread's OpenMP worker teams (see the module docstring); a later parallel
    region on this thread would start a new one. False where no runtime offers a way to.

    That is libgomp's behaviour (PyTorch's wheels). LLVM's and Intel's runtimes, where a build of
    PyTorch links one, share one pool of workers per process and only let the idle ones sleep;
    there a second team never forms, so there is nothing to end."""
    released = False
    for lib in _openmp_runtimes():
        if lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0:
            released = True
        else:
            logger.debug("kvflow: an OpenMP runtime refused to end this thread's workers")
    return released
