"""Per-rank memory plans, from the shapes alone (before anything loads).

Each rank holds its layers' share of the weights and of the KV cache: the KV bytes per token
of a rank are (its layers) x 2 x (its KV heads) x head_dim x element size, so T ranks of a
model with at least T KV heads each hold 1/T of a token's KV, and P stages 1/P of the layers.
Every rank's pool has the same number of blocks (the driver's block tables address all of
them), so the engine takes the smallest count over the ranks.
"""

from __future__ import annotations

import dataclasses

import torch

from kvflow.config import ModelConfig
from kvflow.distributed.config import ParallelConfig
from kvflow.engine.memory_plan import KVCachePlan, _fmt_bytes, plan_kv_cache


def rank_num_parameters(cfg: ModelConfig, parallel: ParallelConfig, rank: int) -> int:
    """Parameters rank `rank` holds: its layers' shards, plus the ends its stage keeps."""
    local = parallel.rank_model_config(cfg, rank)
    h = local.hidden_size
    total = local.num_decoder_parameters()
    first, last = parallel.is_first_stage(rank), parallel.is_last_stage(rank)
    vocab_rows = local.vocab_size * h
    if first or (last and cfg.tie_word_embeddings):
        total += vocab_rows
    if last:
        total += h + (0 if cfg.tie_word_embeddings else vocab_rows)
    return total


def plan_ranks(cfg: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype, block_size: int, max_model_len: int,
               kv_cache_memory: int | None = None, device_memory: int | None = None,
               memory_utilization: float | None = None, quantization=None,
               kv_cache_dtype: str = "auto") -> list[KVCachePlan]:
    """One plan per rank. `device_memory` (bytes per device) with `memory_utilization` (default
    0.9, vLLM's) gives each rank's KV budget after its own weights; otherwise `kv_cache_memory`
    per rank (or the single-process default)."""
    parallel.check_model(cfg)
    plans = []
    elem = torch.tensor([], dtype=dtype).element_size()
    for rank in range(parallel.world_size):
        local = parallel.rank_model_config(cfg, rank)
        weight_bytes = rank_num_parameters(cfg, parallel, rank) * elem
        if quantization is not None:  # a quantized head is the last stage's (T > 1 is refused with quantization)
            weight_bytes += quantization.weight_bytes_delta(local, elem, head=parallel.is_last_stage(rank))
        budget = kv_cache_memory
        if device_memory is not None:
            util = 0.9 if memory_utilization is None else memory_utilization
            budget = int(device_memory * util) - weight_bytes
            if budget <= 0:
                raise ValueError(f"rank {rank}: {_fmt_bytes(weight_bytes)} of weights leave no KV cache memory in "
                                 f"{util} x device_memory={_fmt_bytes(device_memory)}")
        plan = plan_kv_cache(local, dtype, block_size, max_model_len, kv_cache_memory=budget,
                             memory_utilization=None if device_memory is not None else memory_utilization,
                             quantization=quantization, kv_cache_dtype=kv_cache_dtype)
        plans.append(dataclasses.replace(plan, weight_bytes=weight_bytes))
    return plans


def shared_plan(plans: list[KVCachePlan]) -> KVCachePlan:
    """The engine's plan: the rank with the fewest blocks sets the pool size of all."""
    return min(plans, key=lambda p: p.num_blocks)


def describe_ranks(plans: list[KVCachePlan], parallel: ParallelConfig, cfg: ModelConfig) -> str:
    rows = [f"{'rank':>4} {'tp':>3} {'pp':>3} {'layers':>9} {'weights':>11} {'KV B/token':>11} {'blocks':>9} "
            f"{'tokens':>11} {'max concurrency':>16}"]
    for rank, plan in enumerate(plans):
        tp, pp = parallel.rank_coords(rank)
        start, end = parallel.layer_range(cfg.num_hidden_layers, pp)
        rows.append(f"{rank:>4} {tp:>3} {pp:>3} {f'{start}-{end - 1}':>9} {_fmt_bytes(plan.weight_bytes):>11} "
                    f"{plan.bytes_per_token:>11,} {plan.num_blocks:>9,} {plan.num_tokens:>11,} "
                    f"{plan.max_concurrency:>16.2f}")
    engine = shared_plan(plans)
    rows.append(f"every rank's pool has {engine.num_blocks:,} blocks ({engine.num_tokens:,} tokens, "
                f"{engine.max_concurrency:.2f} sequences of {engine.max_model_len:,}): the smallest rank's")
    return "\n".join(rows)
