"""Host memory for the CPU hot paths: large buffers on 2 MiB pages.

The decode step streams every weight and reads KV blocks scattered over the pool. With
4 KiB pages that is a TLB miss every 4 KiB, and the hardware prefetchers stop at each page
boundary. With Linux's transparent huge pages in "madvise" mode, only memory that asks for
them gets 2 MiB pages: the KV pool (`CPUAttentionBackend`) and the packed weights
(`pack_linear_weights`) ask, through `empty_on_huge_pages`.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
from collections.abc import Callable

import torch

HUGE_PAGE = 2 << 20


def empty_on_huge_pages(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor on memory that asked for 2 MiB pages before anything
    touched it.

    The memory is a fresh private anonymous mapping of its own, 2 MiB-aligned, so the hint
    applies to all of it: a torch.empty of a few MiB may come from heap pages malloc already
    touched (it reuses freed chunks below its mmap threshold), where the hint changes nothing.
    Elsewhere than Linux, or below one huge page, a plain torch.empty."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` mapped while it lives
    offset = -raw.data_ptr() % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, offset, (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE)
    return raw[offset: offset + nbytes].view(dtype).view(shape)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def return_freed_heap() -> None:
    """Give the pages of freed heap memory back to the OS (glibc's malloc_trim; a no-op
    elsewhere).

    glibc keeps freed chunks below its mmap threshold resident for reuse. When what replaces
    them lives elsewhere (weights repacked into a huge-page buffer), that memory would stay in
    the process's RSS, unused, for good."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
