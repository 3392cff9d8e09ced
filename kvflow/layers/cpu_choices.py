"""How kvflow's compiled kernels run on this CPU: the process-wide choices that change speed, each
read from its environment variable when the library is loaded and settable afterwards (tests and
benches flip them). AMX tiles or the vector units for bf16 GEMMs (KVFLOW_AMX), vdpbf16ps or
FMAs for bf16 products (KVFLOW_BF16_DOT), and which cache decode attention prefetches into
(KVFLOW_ATTENTION_PREFETCH). Only the AMX choice changes bits (csrc/gemm_amx.h says why);
every bench prints them in its machine line (bench/machine.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger("kvflow")


class KernelChoices:
    """Mixed into CPUKernels, whose `lib`, `avx512_bf16` and `has_gemm_bf16` it reads."""

    lib: ctypes.CDLL
    avx512_bf16: bool
    has_gemm_bf16: bool

    def init_choices(self, amx: str | None) -> None:
        """Each choice from its environment variable ("auto" where unset); `amx` overrides KVFLOW_AMX."""
        self.lib.kvflow_set_bf16_dot.argtypes = [ctypes.c_int]
        self.lib.kvflow_time_bf16_dot.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
        self.bf16_dot = ""  # "dpbf16" or "fma" ("none" without bf16 kernels): set just below
        self.set_bf16_dot(os.environ.get("KVFLOW_BF16_DOT", "auto"))
        self.lib.kvflow_set_amx.argtypes = [ctypes.c_int]
        self.amx = False  # set just below
        self.set_amx(amx if amx is not None else os.environ.get("KVFLOW_AMX", "auto"))
        self.lib.kvflow_set_stream_prefetch.argtypes = [ctypes.c_int]
        self.attention_prefetch = ""  # "l1", "l2" or "none": set just below
        self.set_attention_prefetch(os.environ.get("KVFLOW_ATTENTION_PREFETCH", "auto"))

    def set_attention_prefetch(self, choice: str) -> str:
        """Which cache decode attention's prefetch streams fill ahead of its blocks (csrc/common.h,
        PrefetchStream): "l1", "l2", or "auto" (L2 on Intel CPUs, L1 elsewhere: each measured
        faster on its own). Results are the same bits either way. Returns the one in force
        ("none" where the AVX-512 decode kernel, the only one that streams, is not built)."""
        codes = {"auto": -1, "l1": 0, "l2": 1}
        if choice not in codes:
            raise ValueError(f"KVFLOW_ATTENTION_PREFETCH: expected auto, l1 or l2, got {choice!r}")
        self.attention_prefetch = {0: "l1", 1: "l2"}.get(self.lib.kvflow_set_stream_prefetch(codes[choice]), "none")
        return self.attention_prefetch

    def set_amx(self, choice: str) -> bool:
        """Whether bf16 GEMMs run on AMX tiles (csrc/gemm_amx.h), several times the AVX-512 rate
        where the CPU has them: "auto" (where the CPU and kernel grant the tiles), "on" (an error
        where they do not: a ValueError, which `load` does not turn into a fallback) or "off".
        Its sums round differently from the AVX-512 blocks', so a
        process keeps one setting: bf16 outputs are batch-invariant under either, not equal across
        them. Returns the setting in force."""
        if choice not in ("auto", "on", "off"):
            raise ValueError(f"KVFLOW_AMX: expected auto, on or off, got {choice!r}")
        self.amx = bool(self.lib.kvflow_set_amx(int(choice != "off")))
        if choice == "on" and not self.amx:
            raise ValueError("KVFLOW_AMX=on: this CPU, its kernel or this build offers no AMX bf16 tiles")
        return self.amx

    @contextlib.contextmanager
    def vector_units(self) -> Iterator[None]:
        """Kernel calls inside run on the vector units even where AMX is on. Only for a model
        whose outputs are proposals checked by another (a speculative draft): its bits then
        depend on the rows per call, which its verification makes harmless. At one row a 4-bit
        layer with groups of 32 decodes faster there (the tile unit's per-group loads and
        stores: 2.75 against 3.4 ms for the default model's layers on the AMX Xeon)."""
        if not self.amx:
            yield
            return
        self.lib.kvflow_set_amx(0)
        try:
            yield
        finally:
            self.lib.kvflow_set_amx(1)

    def set_bf16_dot(self, choice: str) -> str:
        """What multiplies bf16 in the GEMM blocks of 4+ rows and in prefill attention: "dpbf16"
        (vdpbf16ps) or "fma" (two float32 FMAs per k-pair), the same bits either way (csrc/dpbf16.h).
        "auto" times both once and keeps FMAs only where clearly faster (vdpbf16ps issued at a
        quarter of the FMA rate on the Intel Xeon measured). Returns the one in force."""
        if choice not in ("auto", "dpbf16", "fma"):
            raise ValueError(f"KVFLOW_BF16_DOT: expected auto, dpbf16 or fma, got {choice!r}")
        if choice == "auto":
            seconds = (ctypes.c_double * 2)()
            timed = self.lib.kvflow_time_bf16_dot(3, seconds) == 0
            choice = "fma" if timed and seconds[1] * 1.15 < seconds[0] else "dpbf16"
            if timed:
                logger.debug("bf16 products: %s (a 12-row block: vdpbf16ps %.0f us, FMAs %.0f us)", choice,
                             seconds[0] * 1e6, seconds[1] * 1e6)
        if not self.avx512_bf16:
            # No vdpbf16ps to choose: gemm_avx2.h always multiplies as the two FMAs, and without
            # AVX2 no kvflow kernel multiplies bf16 at all.
            self.bf16_dot = "fma" if self.has_gemm_bf16 else "none"
            return self.bf16_dot
        self.bf16_dot = "fma" if self.lib.kvflow_set_bf16_dot(int(choice == "fma")) else "dpbf16"
        return self.bf16_dot
