"""Host memory for the CPU hot paths: large buffers on 2 MiB pages.

The decode step streams every weight and reads KV blocks scattered over the pool. With
4 KiB pages that is a TLB miss every 4 KiB, and the hardware prefetchers stop at each page
boundary. With Linux's transparent huge pages in "madvise" mode, only memory that asks for
them gets 2 MiB pages. The KV pool asks (`CPUAttentionBackend`), and so do the packed
weights (`pack_linear_weights`).
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) the 2 MiB-aligned part of a CPU tensor's memory; True if asked.

    Only a hint: with transparent huge pages off (or "never") it changes nothing. It must come
    before the memory is first touched."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    first = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    last = (start + t.numel() * t.element_size()) & ~(HUGE_PAGE - 1)
    if last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_HUGEPAGE) == 0


def empty_on_huge_pages(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor that asked for huge pages before anything touched it.

    Worth it for one large allocation (a fresh mapping of its own); a small one may reuse heap
    pages already resident, where the hint changes nothing."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t
