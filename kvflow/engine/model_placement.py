"""Where and how the model runs, decided before a weight is read: the device, the weights'
format, the ranks (tensor/pipeline parallelism), the KV cache plan; then the runner that drives it.

`LLMEngine` calls `plan_draft_model`, `place_model`, `build_runner` and `build_speculator` once; the scheduler and the step loop are the
same whichever placement they got: one in-process `ModelRunner` (CPU or CUDA), or a
`DriverRunner` that sends each step to worker processes (kvflow.distributed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvflow.config import EngineConfig, ModelConfig
from kvflow.device import check_cuda_engine, resolve_device
from kvflow.distributed.config import ParallelConfig
from kvflow.engine.inputs import load_tokenizer_or_none
from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.memory_plan import KVCachePlan, device_memory_inputs, plan_kv_cache
from kvflow.engine.model_runner import ModelRunner
from kvflow.layers.attention import AttentionBackend, get_attn_backend
from kvflow.loader import load_model, resolve_quantization
from kvflow.quantization.config import QuantizationConfig
from kvflow.spec_decode.speculator import Speculator

logger = logging.getLogger("kvflow")

@dataclass
class ModelPlacement:
    device: torch.device
    quantization: QuantizationConfig | None
    parallel: ParallelConfig
    distributed: Any | None  # kvflow.distributed.launch.DistributedLaunch: ranks in their own processes
    plan: KVCachePlan
    attn_backend: AttentionBackend
    model: nn.Module | None  # None when the workers hold it


@dataclass
class DraftModel:
    """A draft model for speculative decoding, known before the target is placed (its KV shares the plan)."""

    path: str
    config: ModelConfig
    shares_kv: bool  # a self-draft over the target's own layers and KV cache (spec_decode/draft_model.py)


def plan_draft_model(config: EngineConfig, path: str, model_config: ModelConfig,
                     max_model_len: int) -> DraftModel | None:
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    from kvflow.spec_decode.draft_model import draft_model_config, shares_target_kv

    draft_path, draft_cfg = draft_model_config(spec, model_config, max_model_len)
    shares = (shares_target_kv(path, model_config, draft_path, draft_cfg, resolve_device(config.device).type)
              and config.tensor_parallel_size == config.pipeline_parallel_size == 1)
    return DraftModel(draft_path, draft_cfg, shares)


def place_model(config: EngineConfig, path: str, model_config: ModelConfig, dtype: torch.dtype,
                max_model_len: int, draft_cfg: ModelConfig | None, draft_shares_kv: bool = False) -> ModelPlacement:
    """Resolve the device and weight format, start the ranks if any, plan the KV cache and load
    the model (in this process unless ranks hold it). Bad combinations fail here, naming the setting."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        check_cuda_engine(config, device, dtype)
    device_memory, activation_bytes = device_memory_inputs(device, model_config, dtype,
                                                           config.max_num_batched_tokens, config.max_num_seqs)
    # On CUDA a quantized checkpoint (the default model's GGUF blocks) runs dequantized: the
    # integer GEMM kernels are the CPU's.
    method = "none" if device.type == "cuda" and config.quantization is None else config.quantization
    quantization = resolve_quantization(path, method, config.quantization_group_size, config.quantize_lm_head,
                                        config.dtype)
    parallel = ParallelConfig(config.tensor_parallel_size, config.pipeline_parallel_size,
                              config.distributed_executor_backend)
    distributed = None
    if parallel.backend != "uni":
        if device.type == "cuda":
            raise ValueError("tensor_parallel_size/pipeline_parallel_size > 1 runs on the CPU only for now "
                             "(device='cuda' is one GPU); use device='cpu' or one rank")
        from kvflow.distributed.launch import launch

        distributed = launch(parallel, config, path, model_config, dtype, max_model_len, quantization)
    plan = distributed.plan if distributed else plan_kv_cache(
        model_config, dtype, config.block_size, max_model_len,
        kv_cache_memory=config.kv_cache_memory, memory_utilization=config.memory_utilization, draft=draft_cfg,
        draft_shares_kv=draft_shares_kv,
        quantization=quantization, kv_cache_dtype=config.kv_cache_dtype, device_memory=device_memory,
        gpu_memory_utilization=config.gpu_memory_utilization, activation_bytes=activation_bytes,
    )
    attn_backend = get_attn_backend(device)
    model = None if distributed else load_model(path, model_config, dtype, attn_backend, config.load_format,
                                                config.seed, quantization, device=device)
    return ModelPlacement(device, quantization, parallel, distributed, plan, attn_backend, model)


def build_runner(placement: ModelPlacement, config: EngineConfig, model_config: ModelConfig,
                 kv_cache_manager: KVCacheManager, dtype: torch.dtype, eos_token_ids: list[int],
                 max_model_len: int):
    """The runner the engine steps: in-process (with CUDA graphs captured for decode on a GPU), or
    the driver of the distributed ranks (it flattens, sends and samples; the workers run the model)."""
    if placement.distributed:
        from kvflow.distributed.driver_runner import DriverRunner

        return DriverRunner(placement.distributed.executor, model_config, kv_cache_manager, eos_token_ids)
    runner = ModelRunner(placement.model, placement.attn_backend, model_config, kv_cache_manager, dtype,
                         eos_token_ids, config.kv_cache_dtype, device=placement.device)
    if placement.device.type == "cuda" and not config.enforce_eager:
        if model_config.num_experts:  # layers/moe.py reads its routing on the host
            logger.info("%s: decode runs eagerly; a mixture of experts' routing cannot be captured in a CUDA graph",
                        model_config.architecture)
        else:
            runner.capture_decode_graphs(max_model_len, config.max_num_seqs)
    return runner


def build_lora_manager(config: EngineConfig, placement: ModelPlacement, runner: ModelRunner):
    """The LoRA manager over the in-process model (kvflow.lora), attached to `runner`; the
    layouts it cannot serve yet are refused by name."""
    if placement.distributed:
        raise ValueError("enable_lora: LoRA adapters run with one rank only for now "
                         "(tensor_parallel_size = pipeline_parallel_size = 1)")
    if placement.model.config.num_experts:
        raise ValueError(f"enable_lora: LoRA adapters on a mixture-of-experts model "
                         f"({placement.model.config.architecture}) are not supported yet")
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ValueError("enable_lora: not with a draft model's speculative decoding yet (its draft would run "
                         "without the adapter); n-gram speculation works")
    from kvflow.lora.manager import LoRAManager

    runner.lora = LoRAManager(placement.model, placement.model.config, config.lora_config, placement.device)
    return runner.lora


def build_speculator(config: EngineConfig, draft: DraftModel | None, placement: ModelPlacement, runner: Any,
                     tokenizer: Any, dtype: torch.dtype, eos_token_ids: list[int],
                     max_model_len: int) -> Speculator | None:
    """The speculator (n-gram or draft model) when speculative decoding is configured, else None."""
    spec = config.speculative_config
    if spec is None:
        return None
    proposer = None
    if draft is not None:
        from kvflow.spec_decode.draft_model import load_draft_proposer

        draft_tokenizer = load_tokenizer_or_none(draft.path)
        proposer = load_draft_proposer(
            draft.path, draft.config, placement.plan, dtype, placement.attn_backend, eos_token_ids, config.seed,
            target_vocab=tokenizer.get_vocab() if tokenizer is not None else None,
            draft_vocab=draft_tokenizer.get_vocab() if draft_tokenizer is not None else None,
            max_catch_up_tokens=config.max_num_batched_tokens,
            quantization=resolve_quantization(draft.path, spec.quantization, dtype=config.dtype,
                                              quantize_lm_head=spec.quantize_lm_head
                                              and spec.quantization not in (None, "none")),
            target_runner=runner if draft.shares_kv else None)
    return Speculator(spec, max_model_len, proposer)
