"""The shared-memory all-reduce (kvflow/distributed/shm_all_reduce.py) in real processes: sums
in rank order with the same bits on every rank, call after call (the two alternating slot sets),
and a clear error, not a hang, when a rank never comes."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import time
import uuid

import pytest
import torch

from kvflow.distributed.shm_all_reduce import SHM_DIR, ShmAllReduce, shm_all_reduce_supported

pytestmark = pytest.mark.skipif(not shm_all_reduce_supported(), reason="shared-memory all-reduce is x86-only")

SHAPES = [(1, 576), (32, 576), (7, 100), (256, 576), (1, 3)]
DTYPES = [torch.bfloat16, torch.float32]


def _inputs(rank: int, call: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=gen).to(dtype)


def _rank(name: str, rank: int, world: int, calls: int, ready, attached, queue, mismatch: bool = False) -> None:
    torch.set_num_threads(1)
    try:
        if rank != 0:
            ready.wait(60)
        shm = ShmAllReduce(name, rank, world, 1 << 20, create=rank == 0, timeout_s=30)
        if rank == 0:
            ready.set()
        attached.wait(60)
        if rank == 0:
            shm.unlink()  # every rank has it mapped: the name is no longer needed
        results = []
        for call in range(calls):
            shape, dtype = SHAPES[call % len(SHAPES)], DTYPES[call % len(DTYPES)]
            if mismatch and rank == 1:
                dtype = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
            x = shm.all_reduce(_inputs(rank, call, shape, dtype))
            results.append(x.float().numpy().copy())  # exact for bf16; numpy pickles plainly (no fd passing)
        shm.close()
        queue.put((rank, results))
    except Exception as exc:
        queue.put((rank, f"{type(exc).__name__}: {exc}"))


def _run_ranks(world: int, calls: int, mismatch: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    ready, attached, queue = ctx.Event(), ctx.Barrier(world), ctx.Queue()
    name = f"kvflow-test-{uuid.uuid4().hex[:12]}"
    procs = [ctx.Process(target=_rank, args=(name, r, world, calls, ready, attached, queue, mismatch))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        while len(got) < world:
            try:
                rank, result = queue.get(timeout=1)
                got[rank] = result
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a rank died (exit codes {dead})"
    finally:
        for p in procs:
            p.join(30)
        if os.path.exists(os.path.join(SHM_DIR, name)):  # a rank failed before the unlink
            os.unlink(os.path.join(SHM_DIR, name))
    return got


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_rank_order_sum(world):
    calls = 12
    got = _run_ranks(world, calls)
    for call in range(calls):
        shape, dtype = SHAPES[call % len(SHAPES)], DTYPES[call % len(DTYPES)]
        want = _inputs(0, call, shape, dtype) + _inputs(1, call, shape, dtype)
        for r in range(2, world):
            want += _inputs(r, call, shape, dtype)
        for r in range(world):
            assert not isinstance(got[r], str), got[r]
            assert torch.equal(torch.from_numpy(got[r][call]), want.float()), (call, r)


def test_ranks_that_disagree_on_the_size_get_an_error_not_a_wrong_sum():
    got = _run_ranks(2, 1, mismatch=True)
    for r in range(2):
        assert isinstance(got[r], str) and "RuntimeError" in got[r] and "summed" in got[r], got[r]


def test_a_rank_that_never_comes_is_named():
    name = f"kvflow-test-{uuid.uuid4().hex[:12]}"
    shm = ShmAllReduce(name, 0, 2, 4096, create=True, timeout_s=0.3)
    try:
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] .* did not arrive within 0.3 s"):
            shm.all_reduce(torch.ones(4))
        start = time.monotonic()  # the group is out of step now: later calls fail at once
        with pytest.raises(RuntimeError, match="did not arrive"):
            shm.all_reduce(torch.ones(4))
        assert time.monotonic() - start < 0.2
    finally:
        shm.unlink()
        shm.close()


def test_fits_only_cpu_tensors_within_a_slot():
    name = f"kvflow-test-{uuid.uuid4().hex[:12]}"
    shm = ShmAllReduce(name, 0, 2, 4096, create=True)
    try:
        assert shm.fits(torch.ones(1024)) and not shm.fits(torch.ones(1025))
        assert shm.fits(torch.ones(2048, dtype=torch.bfloat16))
    finally:
        shm.unlink()
        shm.close()
