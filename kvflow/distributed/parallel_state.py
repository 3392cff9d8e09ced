"""Process groups on torch.distributed: the world, and one tensor-parallel group per stage.

Only the workers join the world; the driver stays outside it and talks to them through the
executor's pipes, so a driver never blocks in a collective. gloo runs the collectives on the
CPU; on CUDA NCCL would (`backend_for`), with tensors on the rank's device. A tensor-parallel
group whose ranks share a CPU host all-reduces through shared memory instead (shm_all_reduce.py:
microseconds where gloo's loopback TCP takes half a millisecond), gloo remaining for what does
not fit a slot and for groups spread over hosts. Pipeline stages
talk point to point (send/recv on the world group) between the same tensor-parallel rank of
neighbouring stages.
"""

from __future__ import annotations

import datetime
import logging
import socket
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvflow.distributed.config import ParallelConfig
from kvflow.distributed.shm_all_reduce import ShmAllReduce, shm_all_reduce_supported

logger = logging.getLogger("kvflow")


def backend_for(device: str) -> str:
    """The collective library for a device type: NCCL for CUDA, gloo for everything else."""
    return "nccl" if device == "cuda" else "gloo"


@dataclass
class ParallelState:
    """One rank's view of the layout."""

    rank: int
    config: ParallelConfig
    tp_group: "dist.ProcessGroup | None"  # None when tensor_parallel_size == 1
    tp_ranks: list[int]
    shm: ShmAllReduce | None = None  # the group's shared-memory all-reduce, when its ranks share a host

    @property
    def tp_rank(self) -> int:
        return self.config.rank_coords(self.rank)[0]

    @property
    def stage(self) -> int:
        return self.config.rank_coords(self.rank)[1]

    @property
    def is_first_stage(self) -> bool:
        return self.config.is_first_stage(self.rank)

    @property
    def is_last_stage(self) -> bool:
        return self.config.is_last_stage(self.rank)

    @property
    def prev_rank(self) -> int:
        return self.rank - self.config.tensor_parallel_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.config.tensor_parallel_size

    @property
    def all_reduce_method(self) -> str | None:
        """How this rank's tensor-parallel sums travel: "shm", "gloo", or None without a group."""
        if self.tp_group is None:
            return None
        return "shm" if self.shm is not None else "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the tensor-parallel group, in place (every rank gets the same bits)."""
        if self.shm is not None and x.is_contiguous() and self.shm.fits(x):
            return self.shm.all_reduce(x)
        if self.tp_group is not None:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate the group's shards along the last dim on TP rank 0 (None elsewhere)."""
        if self.tp_group is None:
            return x
        first = self.tp_ranks[0]
        parts = [torch.empty_like(x) for _ in self.tp_ranks] if self.rank == first else None
        dist.gather(x.contiguous(), parts, dst=first, group=self.tp_group)
        return torch.cat(parts, dim=-1) if parts is not None else None


def init_parallel_state(rank: int, config: ParallelConfig, init_method: str, device: str = "cpu",
                        timeout_s: float = 60.0) -> ParallelState:
    """Join the world and build every stage's tensor-parallel group (all ranks create all groups,
    as torch.distributed requires). `timeout_s` bounds a collective whose peer is gone."""
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank,
                            world_size=config.world_size, timeout=timeout)
    t = config.tensor_parallel_size
    mine, my_ranks = None, [rank]
    if t > 1:
        for stage in range(config.pipeline_parallel_size):
            ranks = list(range(stage * t, (stage + 1) * t))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine, my_ranks = group, ranks
    state = ParallelState(rank, config, mine, my_ranks)
    if mine is not None and device == "cpu" and shm_all_reduce_supported():
        state.shm = open_shm_all_reduce(rank, my_ranks, mine, timeout_s)
    global _state
    _state = state
    return state


SHM_SLOT_BYTES = 8 << 20  # per rank and call: a 2,048-token chunk at hidden 2,048 in bf16, 576 in float32


def open_shm_all_reduce(rank: int, ranks: list[int], group: "dist.ProcessGroup", timeout_s: float
                         ) -> ShmAllReduce | None:
    """The group's shared segment, created by its first rank; None (gloo, then) unless every rank
    is on this host and could attach. Collective over `group`: every member calls it."""
    hosts: list[str | None] = [None] * len(ranks)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) != 1:
        return None
    creator = rank == ranks[0]
    shm, error = None, None

    def open_segment(name: str) -> None:
        nonlocal shm, error
        try:
            shm = ShmAllReduce(name, ranks.index(rank), len(ranks), SHM_SLOT_BYTES, create=creator,
                               timeout_s=timeout_s)
        except OSError as exc:  # no room in /dev/shm, or the segment could not be attached
            error = f"{type(exc).__name__}: {exc}"

    names: list[str | None] = [None]
    if creator:
        name = f"kvflow-ar-{uuid.uuid4().hex[:16]}"
        open_segment(name)
        names[0] = name if shm is not None else None
    dist.broadcast_object_list(names, src=ranks[0], group=group)  # after the creator made it
    if not creator and names[0] is not None:
        open_segment(names[0])
    try:
        oks: list[bool | None] = [None] * len(ranks)
        dist.all_gather_object(oks, shm is not None, group=group)  # also: every rank has attached
    finally:  # the name goes once all have attached, or at once if that exchange failed: never left behind
        if shm is not None and creator:
            shm.unlink()
    if not all(oks):
        if shm is not None:
            shm.close()
        logger.warning("tensor-parallel all-reduce over gloo, not shared memory (%s): slower at every layer",
                       error or "another rank could not open the segment")
        return None
    return shm


_state: ParallelState | None = None


def destroy_parallel_state() -> None:
    global _state
    if _state is not None and _state.shm is not None:
        _state.shm.close()
    _state = None
    if dist.is_initialized():
        dist.destroy_process_group()
