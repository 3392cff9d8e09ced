"""Compiling kvflow's CPU kernels (kvflow/csrc) with the machine's own compiler.

`g++ -O3 -march=native -fopenmp` over every source, one compiler per core (each source is its own
object, then one link: the set-up's build takes half the time on two cores); the shared library is
cached by a hash of the sources, the flags, the compiler's version and the CPU's flags, so a
library built on one CPU is never loaded on another, and a changed source rebuilds on first use.
`cpu_kernels` loads and calls it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted(_CSRC.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17"]


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


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        import platform

        return platform.processor().encode()


def _simde_flags() -> list[str]:
    """Compiler flags that build the AVX-512 paths on any x86-64 CPU through SIMDe (csrc/isa.h)."""
    try:
        import simde_py
    except ImportError as exc:
        raise RuntimeError("emulating AVX-512 needs the simde-py package (pip install simde-py)") from exc
    # -O1: the emulated library is for checking numerics, and SIMDe's headers make -O3 builds
    # take minutes; no contraction of SIMDe's separate multiplies and adds into FMAs either.
    return ["-O1", "-ffp-contract=off", "-DKVFLOW_SIMDE", f"-I{simde_py.get_include()}"]


def build(verbose: bool = False, emulate_avx512: bool = False) -> Path:
    """Compile the kernels (or find them already compiled) and return the library's path.

    `emulate_avx512` builds a test-only variant whose AVX-512 paths run on any x86-64 CPU,
    emulated instruction by instruction (slowly): CI machines without AVX-512 use it to check
    those kernels' numerics."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    flags = [*(f for f in _FLAGS if f != "-O3"), *_simde_flags()] if emulate_avx512 else _FLAGS
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    # -march=native: a library built on one CPU must not be picked up on another.
    for part in [*(p.read_bytes() for p in _SOURCES + _HEADERS), " ".join(flags).encode(), version.encode(), _cpu_flags()]:
        digest.update(part)
    name = "kvflow_cpu_simde" if emulate_avx512 else "kvflow_cpu"
    target = _cache_dir() / f"{name}_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    # Build to a temporary name and rename: concurrent first uses never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        compile_library(cxx, flags, partial, verbose)
        partial.replace(target)
    return target


def _build_jobs() -> int:
    """Compilers run at once: KVFLOW_BUILD_JOBS, else one per core this process may use (each takes
    up to ~400 MB; set it lower on a many-core machine with little memory)."""
    setting = os.environ.get("KVFLOW_BUILD_JOBS", "")
    if setting:
        if not setting.isdigit() or int(setting) < 1:
            raise ValueError(f"KVFLOW_BUILD_JOBS={setting!r}: expected a positive whole number of compilers")
        return int(setting)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compile_library(cxx: str, flags: list[str], out: Path, verbose: bool = False) -> None:
    """Every source to an object beside `out` (left there: `build` works in a temporary folder), as
    many at a time as this process may use cores or KVFLOW_BUILD_JOBS says (the largest source
    first, so that the longest compile starts at once), then one link into `out`. Raises
    RuntimeError with the compiler's messages."""
    sources = _SOURCES
    objects = {src: out.parent / f"{out.stem}.{src.stem}.o" for src in sources}
    object_flags = [f for f in flags if f != "-shared"]

    def run(what: str, cmd: list[str]) -> str:
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        result = subprocess.run(cmd, capture_output=True, text=True)
        return f"{what}:\n{result.stderr}" if result.returncode != 0 else ""

    jobs = _build_jobs()
    largest_first = sorted(sources, key=lambda src: src.stat().st_size, reverse=True)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        errors = [e for e in pool.map(lambda src: run(src.name, [cxx, *object_flags, "-c", str(src), "-o",
                                                                 str(objects[src])]), largest_first) if e]
    if not errors:
        errors = [e for e in [run("linking", [cxx, *flags, *map(str, objects.values()), "-o", str(out)])] if e]
    if errors:  # the head of the messages: a broken header repeats its error for every source
        raise RuntimeError("building kvflow's CPU kernels failed:\n" + "\n".join(errors)[:4000])


if __name__ == "__main__":
    print(build(verbose=True))
