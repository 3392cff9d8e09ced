"""Fixtures for the kernel tests. kvflow's C++ kernels are part of the install (`make` builds
them and fails without a compiler), so a missing or broken build fails these tests; only a
CPU without AVX512-BF16 skips the bf16 kernels, which are not built for it."""

from __future__ import annotations

import pytest

from kvflow.layers import cpu_kernels


@pytest.fixture(scope="session")
def kernels() -> cpu_kernels.CPUKernels:
    k = cpu_kernels.load()
    assert k is not None, "cpu_kernels.load() returned None: the build failed or KVFLOW_CPU_KERNELS=0"
    return k


@pytest.fixture(scope="session")
def bf16_kernels(kernels) -> cpu_kernels.CPUKernels:
    """The kernels, on a CPU with AVX512-BF16 (the bf16 GEMM and prefill attention)."""
    if not kernels.has_gemm_bf16:
        pytest.skip("this CPU has no AVX512-BF16: kvflow's bf16 kernels are not built for it")
    return kernels
