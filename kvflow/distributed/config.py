"""The parallel layout and each rank's share of the model, decided before anything loads.

Rank r of a T x P layout is tensor-parallel rank `r % T` of pipeline stage `r // T`. A stage
holds a contiguous range of layers (the first stages take one more when P does not divide the
layer count); within a stage each tensor-parallel rank holds H/T query heads, max(1, KV/T) KV
heads (a KV head is replicated on T/KV ranks when T exceeds KV), I/T of the MLP and a
ceil(V/T) slice of the vocabulary (embedding rows and LM-head rows, zero-padded at the end).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvflow.config import ModelConfig

BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """vLLM's names: tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "uni" for one rank, else "mp"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"distributed_executor_backend: {backend!r} is not one of {', '.join(BACKENDS)}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one process, but tensor_parallel_size="
                f"{self.tensor_parallel_size} x pipeline_parallel_size={self.pipeline_parallel_size} asks for "
                f"{self.world_size} ranks; use 'mp' (one process per rank on this machine)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    def check_model(self, cfg: ModelConfig) -> None:
        """Refuse shapes that do not split, naming the numbers."""
        t, p = self.tensor_parallel_size, self.pipeline_parallel_size
        h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if h % t:
            raise ValueError(f"tensor_parallel_size={t} does not divide the model's {h} attention heads")
        if t <= kv and kv % t:
            raise ValueError(f"tensor_parallel_size={t} does not divide the model's {kv} KV heads")
        if t > kv and t % kv:
            raise ValueError(f"tensor_parallel_size={t} exceeds the model's {kv} KV heads and is not a multiple "
                             f"of them, so they cannot be replicated evenly")
        for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(cfg, key) % t:  # (each expert is split like a dense MLP)
                raise ValueError(f"tensor_parallel_size={t} does not divide the model's {key}={getattr(cfg, key)}")
        if p > cfg.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size={p} exceeds the model's {cfg.num_hidden_layers} layers")

    def rank_coords(self, rank: int) -> tuple[int, int]:
        """(tensor-parallel rank, pipeline stage) of a global rank."""
        return rank % self.tensor_parallel_size, rank // self.tensor_parallel_size

    def layer_range(self, num_layers: int, stage: int) -> tuple[int, int]:
        """The contiguous layers [start, end) of a pipeline stage."""
        p = self.pipeline_parallel_size
        base, extra = divmod(num_layers, p)
        start = stage * base + min(stage, extra)
        return start, start + base + (1 if stage < extra else 0)

    def vocab_shard(self, vocab_size: int, tp_rank: int) -> tuple[int, int, int]:
        """(first id, ids held, padded shard size) of a tensor-parallel rank's vocabulary slice."""
        padded = -(-vocab_size // self.tensor_parallel_size)
        start = tp_rank * padded
        return start, max(0, min(padded, vocab_size - start)), padded

    def kv_heads(self, cfg: ModelConfig, tp_rank: int) -> tuple[int, int]:
        """(first KV head, KV heads held) of a tensor-parallel rank."""
        t, kv = self.tensor_parallel_size, cfg.num_key_value_heads
        if t <= kv:
            return tp_rank * (kv // t), kv // t
        return tp_rank // (t // kv), 1

    def rank_model_config(self, cfg: ModelConfig, rank: int) -> ModelConfig:
        """The model a rank builds: its heads, MLP (and every expert's) slice, vocabulary slice and layers."""
        tp_rank, stage = self.rank_coords(rank)
        start, end = self.layer_range(cfg.num_hidden_layers, stage)
        t = self.tensor_parallel_size
        return dataclasses.replace(
            cfg,
            num_attention_heads=cfg.num_attention_heads // t,
            num_key_value_heads=self.kv_heads(cfg, tp_rank)[1],
            intermediate_size=cfg.intermediate_size // t,
            moe_intermediate_size=cfg.moe_intermediate_size // t,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // t,
            vocab_size=self.vocab_shard(cfg.vocab_size, tp_rank)[2],
            num_hidden_layers=end - start,
            moe_layers=[i - start for i in cfg.moe_layers if start <= i < end],  # indices within the stage
        )

    def is_first_stage(self, rank: int) -> bool:
        return self.rank_coords(rank)[1] == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.rank_coords(rank)[1] == self.pipeline_parallel_size - 1

    @property
    def output_rank(self) -> int:
        """The rank whose sampled-row logits (or tokens) go back to the driver: TP rank 0 of the last stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def describe(self) -> str:
        return (f"tensor_parallel_size={self.tensor_parallel_size}, pipeline_parallel_size="
                f"{self.pipeline_parallel_size}, backend={self.backend}")
