"""All-reduce through shared memory, for tensor-parallel ranks on one CPU host.

gloo's all-reduce crosses the loopback TCP stack: 0.3-0.6 ms for a decode step's 1 KB on two
ranks of a two-core machine (`kvflow bench collectives`), and a tensor-parallel layer makes two
of them, so a 30-layer model waits ~20-40 ms a step, more than the whole step of one rank. Ranks
that share a host can instead meet in one shared-memory segment: each copies its tensor into its
own slot and raises its flag; once every flag is up, each rank sums the slots itself, in rank
order, so every rank computes the same bits (as `ParallelState.all_reduce` promises).

Two slot sets alternate between calls: a rank that enters call k+2 (and writes set k % 2 again)
has seen every flag of call k+1, so every rank has left call k and read its slots. Waiting
spins, then yields its core (`os.sched_yield`) to a peer that may share it, and gives up after
`timeout_s` naming the ranks that never came. The ordering argument relies on x86's total store
order (a slot's bytes are visible before the flag written after them); elsewhere gloo is used.
Tensors larger than a slot (long prefill chunks of wide models) also go through gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import time

import numpy as np
import torch

SHM_DIR = "/dev/shm"
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
_FLAG_STRIDE = 16  # int64s between two ranks' flags: 128 bytes, no two flags on one cache line
_SPINS_BEFORE_YIELD = 2000


def shm_all_reduce_supported() -> bool:
    """Shared-memory all-reduce needs x86's store ordering (see the module docstring)."""
    return (platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)
            and os.environ.get("KVFLOW_SHM_ALLREDUCE", "1") != "0")


class ShmAllReduce:
    """One tensor-parallel group's shared segment; `all_reduce(x)` sums x over the group in place."""

    def __init__(self, name: str, rank: int, world: int, slot_bytes: int, create: bool,
                 timeout_s: float = 60.0) -> None:
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        self._flags_bytes = 8 * _FLAG_STRIDE * world
        size = self._flags_bytes + 2 * world * slot_bytes
        # A plain file in /dev/shm, not multiprocessing.shared_memory: that one enrolls the segment
        # with a resource tracker that the spawned ranks share, which cannot count two users of a name.
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
        try:
            if create:  # every page now (ENOSPC here), never a SIGBUS at a first write mid-step
                os.posix_fallocate(fd, 0, size)
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            if create:
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._flags = np.ndarray((world * _FLAG_STRIDE,), dtype=np.int64, buffer=self._mmap)
        self._data = torch.frombuffer(self._mmap, dtype=torch.uint8, offset=self._flags_bytes,
                                      count=2 * world * slot_bytes)
        self._calls = 0
        self._broken: str | None = None

    def unlink(self) -> None:
        """Remove the segment's name once every rank has attached (the mappings stay valid), so a
        crash cannot leave it behind in /dev/shm."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._flags = None  # type: ignore[assignment]
        self._data = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def _slot(self, parity: int, rank: int, x: torch.Tensor) -> torch.Tensor:
        start = (parity * self.world + rank) * self.slot_bytes
        nbytes = x.numel() * x.element_size()
        return self._data[start : start + nbytes].view(x.dtype).view(x.shape)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place; every rank gets the same bits."""
        if self._broken is not None:  # a peer missed a call: the counters no longer line up
            raise RuntimeError(self._broken)
        self._calls += 1
        call, parity = self._calls, self._calls % 2
        self._slot(parity, self.rank, x).copy_(x)
        # What this rank sums (bytes, dtype), beside its flag and per slot set like the slots: a
        # rank already in the next call writes the other set's.
        meta = 1 + 2 * parity
        mine = self.rank * _FLAG_STRIDE
        self._flags[mine + meta] = x.numel() * x.element_size()
        self._flags[mine + meta + 1] = _DTYPE_CODES.get(x.dtype, 0)
        self._flags[mine] = call
        self._wait_for(call)
        for r in range(self.world):
            theirs = r * _FLAG_STRIDE + meta
            if (self._flags[theirs] != self._flags[mine + meta]
                    or self._flags[theirs + 1] != self._flags[mine + meta + 1]):
                self._broken = (f"tensor-parallel all-reduce: rank {r} summed {int(self._flags[theirs])} bytes "
                                f"where rank {self.rank} summed {int(self._flags[mine + meta])} of {x.dtype}")
                raise RuntimeError(self._broken)
        torch.add(self._slot(parity, 0, x), self._slot(parity, 1, x), out=x)
        for r in range(2, self.world):
            x.add_(self._slot(parity, r, x))
        return x

    def _wait_for(self, call: int) -> None:
        flags, stride, spins = self._flags, _FLAG_STRIDE, 0
        deadline = None
        while True:
            if all(flags[r * stride] >= call for r in range(self.world)):
                return
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                os.sched_yield()  # a peer may need this core to arrive at all
                if deadline is None:
                    deadline = time.monotonic() + self.timeout_s
                elif spins % 256 == 0 and time.monotonic() > deadline:
                    missing = [r for r in range(self.world) if flags[r * stride] < call]
                    self._broken = (f"tensor-parallel all-reduce: rank(s) {missing} of the group did not arrive "
                                    f"within {self.timeout_s:g} s")
                    raise RuntimeError(self._broken)
