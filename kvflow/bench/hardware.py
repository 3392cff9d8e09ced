"""This machine's ceilings, measured with plain torch: sustained matmul rate and memory read bandwidth.

A tokens/s figure means little without the ceiling it is measured against, and published
peak numbers are not what torch reaches on a shared, thermally limited CPU, so the ceilings
are measured here, in the same process and thread count as the engine would use, as the
median of several repetitions after a warm-up.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from kvflow.config import resolve_dtype


@dataclass
class Ceilings:
    matmul_gflops: dict[str, float]  # dtype name -> sustained GFLOP/s of an n x n x n torch.mm
    read_gbps: float  # GB/s (1e9 bytes) of a full reduction over a large fp32 tensor
    num_threads: int
    matmul_size: int
    bandwidth_mib: int
    reps: int

    def gflops(self, dtype: torch.dtype | str) -> float:
        name = str(resolve_dtype(dtype)).removeprefix("torch.")
        if name not in self.matmul_gflops:
            raise KeyError(f"no matmul ceiling measured for {name}")
        return self.matmul_gflops[name]


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall time of `fn` over `reps` runs, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(reps, 1)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def matmul_gflops(n: int, dtype: torch.dtype, reps: int = 5) -> float:
    """2 n^3 FLOPs per torch.mm of two n x n matrices, over its median time."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    seconds = median_seconds(lambda: torch.mm(a, b, out=out), reps)
    return 2 * n**3 / seconds / 1e9


@torch.inference_mode()
def read_bandwidth_gbps(mib: int, reps: int = 5) -> float:
    """Bytes of a tensor (larger than the caches) over the median time of summing it."""
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    seconds = median_seconds(lambda: x.sum(), reps)
    return x.numel() * x.element_size() / seconds / 1e9


def measure(dtypes: list[torch.dtype], matmul_size: int = 2048, bandwidth_mib: int = 256, reps: int = 5) -> Ceilings:
    names = []
    for dt in dtypes:
        if dt not in names:
            names.append(dt)
    return Ceilings(
        matmul_gflops={str(dt).removeprefix("torch."): matmul_gflops(matmul_size, dt, reps) for dt in names},
        read_gbps=read_bandwidth_gbps(bandwidth_mib, reps),
        num_threads=torch.get_num_threads(),
        matmul_size=matmul_size,
        bandwidth_mib=bandwidth_mib,
        reps=reps,
    )
