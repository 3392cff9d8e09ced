"""The options every `kvflow` subcommand shares, spelled once: model and KV cache, runtime,
sampling; and how they become an `EngineConfig` and `SamplingParams`."""

from __future__ import annotations

import argparse
import dataclasses

from kvflow.config import EngineConfig, parse_size

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # --uvicorn-log-level (serve, router)


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '1.5GB' or a plain byte count -> bytes (K/M/G alone are binary)."""
    try:
        return parse_size("size", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("size: ")) from None


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """What decides the model's shapes and its KV cache plan (all `kvflow plan` needs)."""
    g = parser.add_argument_group("model and KV cache")
    g.add_argument("--model", default=None,
                   help="HF model directory, config.json, or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    g.add_argument("--quantization", "-q", default=None,
                   help="weights: int8 (per channel), int4 (per group), gguf (a GGUF file's own Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K), "
                        "compressed-tensors or gptq (a checkpoint's own W4A16/W8A16) or none; default: a "
                        "compressed-tensors or GPTQ checkpoint's own, a GGUF file's own when --dtype is auto, else none")
    g.add_argument("--quantization-group-size", type=int, default=None,
                   help="inputs per scale: int4 32 (default), 64, 128...; int8 per channel unless given")
    g.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head too (default: its dtype)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"),
                   help="KV cache storage: auto (the model's dtype) or int8 (a float16 scale per token and KV "
                        "head; 1.94x the tokens of bf16 for head_dim 64)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks each layer is split across (heads, MLP, vocabulary); kv-cache-memory is per rank")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="stages the layers are split into (contiguous ranges, one batch in flight)")
    g.add_argument("--distributed-executor-backend", default=None, choices=("uni", "mp", "ray"),
                   help="uni: this process (one rank); mp: one spawned process per rank (default for more "
                        "than one); ray: Ray actors on RAY_ADDRESS's cluster or a local one (pip install 'kvflow[ray]')")
    mem = g.add_mutually_exclusive_group()
    mem.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV cache size, e.g. 4GiB (default 512MiB, or one max-model-len sequence if more)")
    mem.add_argument("--memory-utilization", type=float, default=None,
                     help="or: fraction of machine memory for weights + KV cache")
    mem.add_argument("--gpu-memory-utilization", type=float, default=None,
                     help="or, on cuda: fraction of the GPU's memory for weights, activations and the KV cache "
                          "(default 0.9)")
    g.add_argument("--device", default="auto", help="auto (cuda when a GPU is visible, else cpu), cpu or cuda")


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """Scheduling and loading options that do not change the memory plan."""
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's own)")
    g.add_argument("--load-format", default="auto", help="auto, safetensors, gguf or dummy")
    g.add_argument("--max-num-seqs", type=int, default=256, help="max sequences per batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="disable prefix caching")
    g.add_argument("--seed", type=int, default=0, help="engine seed")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="cuda: run decode steps eagerly, without capturing CUDA graphs")
    g.add_argument("--generation-config", default="auto",
                   help="sampling defaults for fields a request leaves unset: auto (the model's own: "
                        "generation_config.json, GGUF metadata, or for the default model its card's "
                        "temperature 0.2, top_p 0.9), vllm (vLLM's: temperature 1.0), or a folder "
                        "with generation_config.json")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(keys: method, num_speculative_tokens, prompt_lookup_min/max, disable_by_batch_size, "
                        "min_mean_accepted; see docs/architecture.md)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) over the model, chosen per request")
    g.add_argument("--max-loras", type=int, default=1, help="LoRA: distinct adapters in one batch (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="LoRA: the largest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="LoRA: loaded adapters kept while no request uses them (default --max-loras)")
    g.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='how /v1/embeddings pools a prompt, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' '
                        "(default: the last token, L2-normalised)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    """Sampling flags; an omitted one is unset, so the model's default (--generation-config) applies."""
    g = parser.add_argument_group("sampling (omitted: the model's default, see --generation-config)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens to generate (default: the model's, else {max_tokens})")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None)
    g.add_argument("--verbose", action="store_true",
                   help="after each answer, print prompt and output tokens, TTFT and tokens/s")
    parser.set_defaults(cli_max_tokens=max_tokens)


_SAMPLING_FLAGS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "sampling_seed": "seed", "stop": "stop", "ignore_eos": "ignore_eos"}


def sampling_params_from_args(args: argparse.Namespace):
    """SamplingParams of the flags given (checked now, before any weights load); the rest stay unset."""
    from kvflow.sampling.params import SamplingParams

    given = {field: getattr(args, flag) for flag, field in _SAMPLING_FLAGS.items() if getattr(args, flag) is not None}
    return SamplingParams(**given)


def with_cli_defaults(params, args: argparse.Namespace, llm):
    """Precedence: a flag, then the model's default (generation_config), then this command's max_tokens."""
    return params.with_defaults({"max_tokens": args.cli_max_tokens, **llm.engine.sampling_defaults.values})


def format_stats(out) -> str:
    """Ollama's --verbose, in short: token counts, time to first token and generation speed."""
    m, n_out = out.metrics, len(out.outputs[0].token_ids)
    ttft = (m.first_token_time - m.arrival_time) if m.first_token_time else float("nan")
    end = m.finished_time or m.last_token_time or m.first_token_time
    decode_s = (end - m.first_token_time) if m.first_token_time and end else 0.0
    # Tokens after the first over the time they took (the first one's time is the TTFT).
    rate = f"{(n_out - 1) / decode_s:.1f} tokens/s" if n_out > 1 and decode_s > 0 else "n/a"
    total = (end - m.arrival_time) if end else float("nan")
    return (f"prompt: {len(out.prompt_token_ids)} tokens ({out.num_cached_tokens} cached) | output: {n_out} tokens"
            f" | TTFT: {ttft * 1e3:.0f} ms | generation: {rate} | total: {total:.2f} s")
