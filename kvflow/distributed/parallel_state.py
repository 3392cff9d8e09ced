"""Process groups on torch.distributed: the world, and one tensor-parallel group per stage.

Only the workers join the world; the driver stays outside it and talks to them through the
executor's pipes, so a driver never blocks in a collective. gloo runs the collectives on the
CPU; on CUDA NCCL would (`backend_for`), with tensors on the rank's device. Pipeline stages
talk point to point (send/recv on the world group) between the same tensor-parallel rank of
neighbouring stages.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvflow.distributed.config import ParallelConfig


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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the tensor-parallel group, in place (every rank gets the same bits)."""
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
    return ParallelState(rank, config, mine, my_ranks)


def destroy_parallel_state() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
