"""kvflow's Triton kernels for the tests: compiled for the GPU where there is one, else run by
Triton's interpreter on CPU tensors. The interpreter must be on before triton is first imported
(tests/conftest.py sets TRITON_INTERPRET=1 on machines without a GPU)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def load_kernels():
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1: the Triton kernels have nowhere to run",
                    allow_module_level=True)
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # triton ships wheels for Linux only
        pytest.skip(f"triton cannot be imported ({exc}); the CUDA backend's kernels need it", allow_module_level=True)
    return importlib.import_module("kvflow.layers.triton")
