"""A worker: one rank's process. It owns a model shard, its KV pool and a `StageRunner`, and
executes the step messages it is sent, in order. It never schedules.

Protocol on its pipe to the driver: after start-up it sends ("ready", info) or ("error",
why); then it receives ("step", StepMessage) or ("stop", None). The output rank answers each
step with ("ok", StepResult); any rank that fails answers ("error", traceback) and exits. A
heartbeat thread stamps a shared clock every `HEARTBEAT_S`, so the driver can tell a hung
process (no stamps: stopped, or stuck holding the interpreter) from a slow step. A closed pipe
(the driver is gone) ends the worker.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvflow.config import ModelConfig
from kvflow.distributed.config import ParallelConfig
from kvflow.distributed.layers import make_row_parallel, shard_weights
from kvflow.distributed.parallel_state import destroy_parallel_state, init_parallel_state
from kvflow.distributed.stage import StageRunner

HEARTBEAT_S = 0.5


@dataclass
class WorkerSpec:
    """Everything a rank needs to build its share; picklable, sent once at spawn."""

    model_path: str
    model_config: ModelConfig
    parallel: ParallelConfig
    dtype: torch.dtype
    load_format: str
    seed: int
    quantization: Any  # QuantizationConfig | None
    num_blocks: int
    block_size: int
    kv_cache_dtype: str
    init_method: str
    num_threads: int
    collective_timeout_s: float = 60.0


def _trim_for_rank(parallel: ParallelConfig, rank: int, tied: bool):
    """Drop the ends a rank does not hold: the embedding past the first stage (unless the last
    stage's tied LM head is stored in it), the final norm and LM head before the last."""
    first, last = parallel.is_first_stage(rank), parallel.is_last_stage(rank)

    def trim(model: nn.Module) -> None:
        if not last:
            model.norm = None
            model.lm_head = None
        if not first and not (last and tied):
            model.embed_tokens = None
    return trim


def build_stage(spec: WorkerSpec, rank: int, state) -> StageRunner:
    from kvflow.layers.attention import get_attn_backend
    from kvflow.loader import load_model

    parallel, cfg = spec.parallel, spec.model_config
    local = parallel.rank_model_config(cfg, rank)
    backend = get_attn_backend("cpu")
    model = load_model(spec.model_path, local, spec.dtype, backend, spec.load_format, spec.seed, spec.quantization,
                       adapt_model=_trim_for_rank(parallel, rank, cfg.tie_word_embeddings),
                       adapt_weights=lambda weights: shard_weights(weights, cfg, parallel, rank),
                       fuse_stack=False)
    make_row_parallel(model, state)
    kv_caches = backend.allocate_kv_caches(local.num_hidden_layers, spec.num_blocks, spec.block_size,
                                           local.num_key_value_heads, local.head_dim, spec.dtype, spec.kv_cache_dtype)
    fused = None
    if parallel.tensor_parallel_size == 1 and hasattr(model, "fuse_stack"):  # a Llama stage: its layers in one call
        from kvflow.models.llama_fused import FusedLlamaStack

        fused = FusedLlamaStack.build(model)
    return StageRunner(model, kv_caches, state, cfg, spec.dtype, fused)


def _beat(clock, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        clock.value = time.monotonic()


def worker_main(rank: int, spec: WorkerSpec, conn, clock) -> None:
    """The process entry point (spawned by the executor)."""
    torch.set_num_threads(max(1, spec.num_threads))
    stop = threading.Event()
    clock.value = time.monotonic()
    threading.Thread(target=_beat, args=(clock, stop), daemon=True, name="kvflow-heartbeat").start()
    try:
        state = init_parallel_state(rank, spec.parallel, spec.init_method, timeout_s=spec.collective_timeout_s)
        runner = build_stage(spec, rank, state)
    except BaseException as exc:  # report why, then exit: the driver refuses to start
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", {"pid": os.getpid(), "rank": rank, "fused_stack": runner.fused is not None,
                         "all_reduce": state.all_reduce_method}))
    is_output = rank == spec.parallel.output_rank
    try:
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):  # the driver is gone
                break
            if kind == "stop":
                break
            try:
                result = runner.execute(payload)
            except BaseException as exc:
                conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
                return
            if is_output:
                conn.send(("ok", result))
    finally:
        stop.set()
        try:
            destroy_parallel_state()
        except Exception:
            pass
