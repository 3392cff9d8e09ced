"""kvflow's own CPU kernels (kvflow/csrc), compiled with the machine's compiler on first use.

The kernels are plain C++ with OpenMP and no PyTorch headers, so a build takes about a
second, and they are called through ctypes with raw data pointers. The shared library is
cached by a hash of its source, flags and compiler; `make` builds it at install time
(`python -m kvflow.layers.cpu_kernels`). Without a compiler, or with KVFLOW_CPU_KERNELS=0,
`load()` returns None and callers use their PyTorch path: slower, never different in meaning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("kvflow")

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = [_CSRC / "paged_attention.cpp", _CSRC / "gemm_bf16.cpp"]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17"]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _cache_dir() -> Path:
    """Next to the sources when writable (an editable install), else the user's cache."""
    local = Path(__file__).resolve().parent.parent / "_build"
    try:
        local.mkdir(exist_ok=True)
        if os.access(local, os.W_OK):
            return local
    except OSError:
        pass
    user = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvflow"
    user.mkdir(parents=True, exist_ok=True)
    return user


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build(verbose: bool = False) -> Path:
    """Compile the kernels (or find them already compiled) and return the library's path."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in [*(p.read_bytes() for p in _SOURCES), " ".join(_FLAGS).encode(), version.encode()]:
        digest.update(part)
    target = _cache_dir() / f"kvflow_cpu_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    # Build to a temporary name and rename: concurrent first uses never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    cmd = [cxx, *_FLAGS, *map(str, _SOURCES), "-o", str(partial)]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building kvflow's CPU kernels failed:\n{result.stderr[-4000:]}")
    partial.replace(target)
    return target


class CPUKernels:
    """Typed entry points into the compiled library."""

    def __init__(self, path: Path) -> None:
        # torch loaded its libgomp first; the library's libgomp.so.1 resolves to that same copy.
        self.lib = ctypes.CDLL(str(path))
        self.path = path
        fn = self.lib.kvflow_paged_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._decode = fn
        self.max_group = self.lib.kvflow_max_group()
        self.max_head_dim = self.lib.kvflow_max_head_dim()
        self.lib.kvflow_pack_bf16_weight.argtypes = [ptr, i64, i64, ptr]
        self.lib.kvflow_pack_bf16_weight.restype = None
        self.lib.kvflow_gemm_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64]
        self.lib.kvflow_gemm_bf16.restype = ctypes.c_int
        self.has_gemm_bf16 = bool(self.lib.kvflow_has_gemm_bf16())

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (
            dtype in _DTYPE_CODES
            and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= self.max_group
            and head_dim <= self.max_head_dim
        )

    def paged_decode_attention(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim], contiguous
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, >= max blocks] int64, contiguous
        seq_lens: torch.Tensor,  # [num_seqs] int64
        scale: float,
        portable: bool = False,
    ) -> torch.Tensor:
        """`portable` forces the plain C++ loops instead of the AVX-512 path (tests check both)."""
        num_seqs, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache),
                        ("block_tables", block_tables), ("seq_lens", seq_lens)):
            if not t.is_contiguous():
                raise ValueError(f"paged_decode_attention: {name} must be contiguous")
        if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
            raise ValueError("paged_decode_attention: block_tables and seq_lens must be int64")
        out = torch.empty_like(q)
        rc = self._decode(
            _DTYPE_CODES[q.dtype], q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, int(portable),
        )
        if rc != 0:
            raise ValueError(f"paged_decode_attention: unsupported shape (code {rc})")
        return out

    def pack_bf16_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bf16 -> the [ceil(N/16), K/2, 16, 2] layout `gemm_bf16` streams (K must be even)."""
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or k % 2:
            raise ValueError("pack_bf16_weight: needs a bf16 [N, K] weight with K even")
        weight = weight.contiguous()
        packed = torch.empty(((n + 15) // 16, k // 2, 16, 2), dtype=torch.bfloat16)
        self.lib.kvflow_pack_bf16_weight(weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def gemm_bf16(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] bf16 @ W^T (+ bias) for a weight packed by `pack_bf16_weight`; [M, N] bf16."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        if k != packed.shape[1] * 2 or n > packed.shape[0] * 16:
            raise ValueError(f"gemm_bf16: x {tuple(x.shape)} does not fit packed weight {tuple(packed.shape)} for N={n}")
        y = torch.empty((m, n), dtype=torch.bfloat16)
        bias_ptr = None if bias is None else bias.contiguous().data_ptr()
        rc = self.lib.kvflow_gemm_bf16(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, bias_ptr, y.data_ptr(), n)
        if rc != 0:
            raise RuntimeError(f"gemm_bf16 failed (code {rc})")
        return y


@functools.cache
def load() -> CPUKernels | None:
    """The compiled kernels, or None (logged once) when they are disabled or cannot be built."""
    if os.environ.get("KVFLOW_CPU_KERNELS", "1") == "0":
        return None
    try:
        return CPUKernels(build())
    except (RuntimeError, OSError) as exc:
        logger.warning("kvflow CPU kernels unavailable, using the PyTorch path: %s", exc)
        return None


if __name__ == "__main__":
    print(build(verbose=True))
