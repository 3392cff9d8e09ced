"""`kvflow plan`: the KV cache memory plan (one device, or each rank's), without loading weights."""

from __future__ import annotations

import argparse

from kvflow.config import EngineConfig
from kvflow.entrypoints.cli_args import add_model_args, engine_config_from_args, parse_bytes


def register_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the KV cache memory plan without loading weights")
    add_model_args(p)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="plan a draft model's weights and KV cache beside the target's")
    p.add_argument("--device-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="memory of each device, e.g. 80GiB: one rank plans a GPU with this much free "
                        "(without it, --device cuda plans for the GPU present); with tensor/pipeline "
                        "parallelism each rank's KV cache is --memory-utilization (default 0.9) of it minus "
                        "the rank's weights, one row per rank")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    import torch

    from kvflow.config import resolve_dtype, resolve_max_model_len
    from kvflow.engine.memory_plan import plan_kv_cache
    from kvflow.loader import load_model_config, resolve_model_path, resolve_quantization
    from kvflow.spec_decode.config import SpeculativeConfig

    config = engine_config_from_args(args)  # the engine's own checks of every option, before any plan is printed
    path = resolve_model_path(args.model)
    cfg = load_model_config(path)
    dtype = resolve_dtype(args.dtype, cfg)
    max_model_len = resolve_max_model_len(cfg, args.max_model_len)
    spec = SpeculativeConfig.parse(args.speculative_config)
    draft, draft_path = None, None
    if spec is not None and spec.method == "draft_model":
        from kvflow.spec_decode.draft_model import draft_model_config

        draft_path, draft = draft_model_config(spec, cfg, max_model_len)
    quantization = resolve_quantization(path, args.quantization, args.quantization_group_size,
                                        args.quantize_lm_head, args.dtype)
    if quantization is not None:
        quantization.check_model(cfg)  # a group size some layer cannot split is refused here, as at load
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        return _plan_ranks(args, config, path, cfg, dtype, max_model_len, quantization)
    from kvflow.device import resolve_device
    from kvflow.engine.memory_plan import device_memory_inputs

    if args.device_memory is not None and str(args.device).lower() == "cpu":
        raise ValueError("--device-memory plans for a GPU; it does not go with --device cpu")
    defaults = EngineConfig()  # plan has no scheduling flags: the activation reserve of the defaults
    device_memory, activation_bytes = device_memory_inputs(
        resolve_device(args.device) if args.device_memory is None else torch.device("cuda"), cfg, dtype,
        defaults.max_num_batched_tokens, defaults.max_num_seqs, args.device_memory)
    on_gpu = device_memory is not None
    draft_shares_kv = False
    if draft is not None:
        from kvflow.spec_decode.draft_model import shares_target_kv

        draft_shares_kv = shares_target_kv(path, cfg, draft_path, draft, "cuda" if on_gpu else "cpu")
    if on_gpu and args.quantization is None:  # CUDA runs a quantized checkpoint dequantized
        quantization = resolve_quantization(path, "none", args.quantization_group_size, args.quantize_lm_head,
                                            args.dtype)
    plan = plan_kv_cache(cfg, dtype, args.block_size, max_model_len, kv_cache_memory=args.kv_cache_memory,
                         memory_utilization=args.memory_utilization, draft=draft, draft_shares_kv=draft_shares_kv,
                         quantization=quantization,
                         kv_cache_dtype=args.kv_cache_dtype, device_memory=device_memory,
                         gpu_memory_utilization=args.gpu_memory_utilization, activation_bytes=activation_bytes)
    if device_memory is not None:
        print(f"device: GPU with {device_memory[0] / (1 << 30):.2f} GiB free of {device_memory[1] / (1 << 30):.2f} GiB "
              f"(activations reserved: {activation_bytes / (1 << 30):.2f} GiB)")
    print(f"model: {path} ({cfg.architecture}, {cfg.num_parameters() / 1e9:.2f} B parameters{_experts(cfg)})")
    print(plan.describe())
    return 0


def _experts(cfg) -> str:
    """A mixture of experts' shape and what a token reads of it (its decode cost), or ""."""
    if not cfg.num_experts:
        return ""
    active = cfg.num_linear_parameters(active=True) + cfg.vocab_size * cfg.hidden_size
    return (f"; {cfg.num_experts} experts, top {cfg.num_experts_per_tok}, in {len(cfg.moe_layers)} of "
            f"{cfg.num_hidden_layers} layers: a token reads {active / 1e9:.2f} B")


def _plan_ranks(args: argparse.Namespace, config: EngineConfig, path: str, cfg, dtype, max_model_len: int,
                quantization) -> int:
    """`kvflow plan -tp T -pp P [--device-memory 80GiB]`: one row per rank (kvflow.distributed.plan).
    What `serve` would refuse on any machine is refused here too (this machine's core count is not:
    the plan may be for another)."""
    from kvflow.distributed.config import ParallelConfig
    from kvflow.distributed.launch import check_layout
    from kvflow.distributed.plan import describe_ranks, plan_ranks

    parallel = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size)
    check_layout(parallel, config, cfg, quantization)
    plans = plan_ranks(cfg, parallel, dtype, args.block_size, max_model_len, kv_cache_memory=args.kv_cache_memory,
                       device_memory=args.device_memory, memory_utilization=args.memory_utilization,
                       quantization=quantization, kv_cache_dtype=args.kv_cache_dtype)
    memory = (f"{args.device_memory / (1 << 30):.0f} GiB per device x {args.memory_utilization or 0.9}"
              if args.device_memory is not None else "kv-cache-memory per rank")
    print(f"model: {path} ({cfg.architecture}, {cfg.num_parameters() / 1e9:.2f} B parameters{_experts(cfg)}, "
          f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, {cfg.num_hidden_layers} layers)")
    print(f"layout: {parallel.world_size} ranks = tensor_parallel_size {parallel.tensor_parallel_size} x "
          f"pipeline_parallel_size {parallel.pipeline_parallel_size}; {memory}; dtype "
          f"{str(dtype).removeprefix('torch.')}, KV {plans[0].kv_dtype_name}, max model len {max_model_len:,}")
    print(describe_ranks(plans, parallel, cfg))
    return 0
