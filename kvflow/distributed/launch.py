"""Start the workers of a distributed engine: plan per rank, spawn, wait for every rank.

Called by `LLMEngine` when the layout has more than one rank (or names a backend other than
"uni"); everything the single-process path does not need stays here.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from kvflow.config import EngineConfig, ModelConfig
from kvflow.distributed.config import ParallelConfig
from kvflow.distributed.executor import Executor, MPExecutor
from kvflow.distributed.plan import describe_ranks, plan_ranks, shared_plan
from kvflow.distributed.worker import WorkerSpec
from kvflow.engine.cpu_threads import usable_cpus
from kvflow.engine.memory_plan import KVCachePlan

logger = logging.getLogger("kvflow")


@dataclass
class DistributedLaunch:
    executor: Executor
    plan: KVCachePlan  # the engine's (the smallest rank's blocks)
    rank_plans: list[KVCachePlan]
    start_seconds: float


def check_servable(parallel: ParallelConfig, config: EngineConfig, model_config: ModelConfig, quantization) -> None:
    """Refuse, before any process starts, what the distributed path does not run here."""
    check_layout(parallel, config, model_config, quantization)
    cores = usable_cpus()
    if parallel.backend == "mp" and parallel.world_size > cores and os.environ.get("KVFLOW_OVERSUBSCRIBE") != "1":
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {parallel.world_size} ranks, but this "
                         f"process may use {cores} CPU cores (KVFLOW_OVERSUBSCRIBE=1 runs them anyway, sharing cores)")


def check_layout(parallel: ParallelConfig, config: EngineConfig, model_config: ModelConfig, quantization) -> None:
    """Refuse what the distributed path runs on no machine: a split the model's shapes do not allow,
    and what it does not support yet. `kvflow plan` checks this too, as it plans for other machines."""
    parallel.check_model(model_config)
    if config.speculative_config is not None and config.speculative_config.method == "draft_model":
        raise ValueError("speculative_config: a draft model is not supported with the distributed executor yet "
                         "(the n-gram proposer is)")
    if quantization is not None and parallel.tensor_parallel_size > 1:
        raise ValueError(f"quantization={quantization.method}: tensor_parallel_size="
                         f"{parallel.tensor_parallel_size} splits float weights only for now; pass "
                         "quantization='none' (or an explicit dtype for a GGUF file)")


def launch(parallel: ParallelConfig, config: EngineConfig, path: str, model_config: ModelConfig,
           dtype: torch.dtype, max_model_len: int, quantization) -> DistributedLaunch:
    check_servable(parallel, config, model_config, quantization)
    plans = plan_ranks(model_config, parallel, dtype, config.block_size, max_model_len,
                       kv_cache_memory=config.kv_cache_memory, memory_utilization=config.memory_utilization,
                       quantization=quantization, kv_cache_dtype=config.kv_cache_dtype)
    plan = shared_plan(plans)
    threads = config.num_threads or max(1, usable_cpus() // parallel.world_size)
    start = time.perf_counter()

    def spec(init_method: str) -> WorkerSpec:
        return WorkerSpec(path, model_config, parallel, dtype, config.load_format, config.seed, quantization,
                          plan.num_blocks, config.block_size, config.kv_cache_dtype, init_method, threads)

    if parallel.backend == "ray":  # the cluster's CPUs are checked once connected
        from kvflow.distributed.ray_executor import RayExecutor

        executor: Executor = RayExecutor(spec, parallel.world_size, parallel.output_rank)
    else:
        executor = MPExecutor(spec, parallel.world_size, parallel.output_rank)
    seconds = time.perf_counter() - start
    fused = sum(bool(info.get("fused_stack")) for info in executor.worker_info)
    sums = sorted({str(info.get("all_reduce")) for info in executor.worker_info if info.get("all_reduce")})
    logger.info("kvflow: %d workers (%s) ready in %.1f s, %d thread(s) each, %d running their layers as one "
                "fused C++ call%s\n%s", parallel.world_size, parallel.describe(), seconds, threads, fused,
                f", tensor-parallel all-reduce over {'/'.join(sums)}" if sums else "",
                describe_ranks(plans, parallel, model_config))
    return DistributedLaunch(executor, plan, plans, seconds)
