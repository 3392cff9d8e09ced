"""The `kvflow` command: serve, generate, chat, plan and bench.

Each subcommand registers itself from one `register_*` function listed in `SUBCOMMANDS`, so
a new one (say `bench`) is one function and one list entry; engine options are shared by
`add_model_args` / `add_runtime_args` so every subcommand spells them the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from typing import Callable

from kvflow.config import EngineConfig

logger = logging.getLogger("kvflow")

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '1.5GB' or a plain byte count -> bytes (K/M/G alone are binary)."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4GiB, 512MiB or a number of bytes)")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


# ---- shared options -------------------------------------------------------------------------
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
    mem = g.add_mutually_exclusive_group()
    mem.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV cache size, e.g. 4GiB (default 512MiB, or one max-model-len sequence if more)")
    mem.add_argument("--memory-utilization", type=float, default=None,
                     help="or: fraction of machine memory for weights + KV cache")


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
    g.add_argument("--generation-config", default="auto",
                   help="sampling defaults for fields a request leaves unset: auto (the model's own: "
                        "generation_config.json, GGUF metadata, or for the default model its card's "
                        "temperature 0.2, top_p 0.9), vllm (vLLM's: temperature 1.0), or a folder "
                        "with generation_config.json")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(keys: method, num_speculative_tokens, prompt_lookup_min/max, disable_by_batch_size, "
                        "min_mean_accepted; see docs/architecture.md)")


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


# ---- serve ----------------------------------------------------------------------------------
def register_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_model_args(p)
    add_runtime_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("KVFLOW_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVFLOW_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="refuse requests (HTTP 503 with Retry-After) when this many are already waiting for a "
                        "batch slot (default: --max-num-seqs; -1: no limit)")
    g.add_argument("--max-request-bytes", type=parse_bytes, default=32 << 20,
                   help="refuse larger request bodies (HTTP 413) before reading them, e.g. 8MiB (default 32MiB)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let requests in flight finish before aborting them (new ones "
                        "get 503 meanwhile); a second SIGTERM exits at once")
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='prefill/decode disaggregation: \'{"kv_role": "kv_producer"}\' (a prefill instance; keys '
                        "kv_host, kv_port: where it serves its prompt blocks) or '{\"kv_role\": \"kv_consumer\"}' "
                        "(a decode instance; kv_timeout_s: how long it waits for them before computing the prompt "
                        "itself); see kvflow router --prefill/--decode")
    g.add_argument("--in-process-engine", action="store_true",
                   help="run the engine loop in the API server's process (a thread) instead of its own engine "
                        "core process")
    g.add_argument("--uvicorn-log-level", default="info")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from kvflow.entrypoints.async_engine import AsyncEngine
    from kvflow.entrypoints.openai.lifecycle import serve_until_drained
    from kvflow.entrypoints.openai.server import build_app

    if args.shutdown_timeout < 0:  # before the weights load
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    max_waiting = args.max_num_seqs if args.max_waiting is None else args.max_waiting
    kv_transfer = None
    if args.kv_transfer_config is not None:  # checked before the weights load
        from kvflow.kv_transfer.config import KVTransferConfig

        kv_transfer = KVTransferConfig.parse(args.kv_transfer_config)
        if not args.enable_prefix_caching:
            raise ValueError("--kv-transfer-config needs prefix caching: transferred blocks enter the prefix cache")
    engine_class = AsyncEngine
    if not args.in_process_engine:  # the engine loop in its own process, over ZMQ (entrypoints/core/)
        from kvflow.entrypoints.core.client import EngineCoreClient as engine_class
    engine = engine_class.from_config(engine_config_from_args(args), max_waiting=None if max_waiting < 0 else max_waiting,
                                      kv_transfer_config=kv_transfer)
    if not args.in_process_engine:
        logger.info("engine core: process %d (the API server tokenizes and streams; --in-process-engine for one "
                    "process)", engine.core_pid)
    logger.info("admission: at most %s request(s) waiting (--max-waiting), then 503; SIGTERM drains for at most "
                "%g s (--shutdown-timeout)", max_waiting if max_waiting >= 0 else "unlimited", args.shutdown_timeout)
    name = args.served_model_name or args.model or DEFAULT_SERVED_NAME
    app = build_app(engine, name, args.api_key, max_request_bytes=args.max_request_bytes)
    url = f"http://{args.host}:{args.port}"
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    # The engine has already logged the KV cache plan while loading.
    logger.info("model: %s (served as %r), dtype: %s", engine.model_path, name, engine.dtype_name)
    logger.info("%s; a request's own fields win (--generation-config vllm: none), see /v1/models",
                engine.sampling_defaults.describe())
    logger.info("serving on %s/v1 (health: %s/health, metrics: %s/metrics)", url, url, url)
    logger.info("try: curl %s/v1/completions -H 'Content-Type: application/json'%s "
                "-d '{\"model\": \"%s\", \"prompt\": \"Hello, my name is\", \"max_tokens\": 32}'", url, auth, name)
    try:
        return serve_until_drained(app, engine, args.host, args.port, args.uvicorn_log_level, args.shutdown_timeout)
    finally:
        engine.shutdown()


# ---- generate / chat ------------------------------------------------------------------------
def _build_llm(args: argparse.Namespace):
    from kvflow.entrypoints.llm import LLM

    return LLM(**dataclasses.asdict(engine_config_from_args(args)))


def register_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt and print the text")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user message first")
    add_model_args(p)
    add_runtime_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)  # fail on bad options before loading weights
    llm = _build_llm(args)
    params = with_cli_defaults(params, args, llm)
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat_template else args.prompt
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    if args.verbose:  # on stderr, so that stdout stays the text alone
        print(f"{params}\n{format_stats(out)}", file=sys.stderr)
    return 0


def register_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat in the terminal (/reset, /exit)")
    p.add_argument("--system", default=None, help="system prompt")
    add_model_args(p)
    add_runtime_args(p)
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=run_chat)


_EXIT, _RESET = ("/exit", "/quit", "/bye"), ("/reset", "/clear")
_CHAT_HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"


def run_chat(args: argparse.Namespace, stdin=None, stdout=None) -> int:
    """Reads a line, streams the reply, keeps the history (through the chat template) until /reset."""
    from kvflow.entrypoints.openai.server import TextStreamer

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    params = sampling_params_from_args(args)
    llm = _build_llm(args)
    params = with_cli_defaults(params, args, llm)
    engine = llm.engine
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    stdout.write(f"{params}. {_CHAT_HELP}.\n")
    turn = 0
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line:
            stdout.write("\n")
            break
        text = line.strip()
        if text in _EXIT:
            break
        if text in _RESET:
            history = list(system)
            stdout.write("(new conversation)\n")
            continue
        if text in ("/help", "/?"):
            stdout.write(_CHAT_HELP + "\n")
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        request_id, streamer, reply, final = f"chat-{turn}", TextStreamer(params.stop), "", None
        turn += 1
        try:
            engine.add_request(request_id, llm.apply_chat_template(history), params)
        except ValueError as exc:  # the conversation outgrew max_model_len: say so, keep the session
            history.pop()
            stdout.write(f"error: {exc}\n(/reset starts a new conversation)\n")
            continue
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    reply, final = out.outputs[0].text, out
                    stdout.write(streamer.delta(reply, out.finished))
                    stdout.flush()
        except KeyboardInterrupt:
            engine.abort_request(request_id)
            reply = reply[:streamer.sent]
        stdout.write("\n")
        if args.verbose and final is not None:
            stdout.write(format_stats(final) + "\n")
        history.append({"role": "assistant", "content": reply})
    return 0


# ---- plan -----------------------------------------------------------------------------------
def register_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the KV cache memory plan without loading weights")
    add_model_args(p)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="plan a draft model's weights and KV cache beside the target's")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from kvflow.config import resolve_dtype, resolve_max_model_len
    from kvflow.engine.memory_plan import plan_kv_cache
    from kvflow.loader import load_model_config, resolve_model_path, resolve_quantization
    from kvflow.spec_decode.config import SpeculativeConfig

    path = resolve_model_path(args.model)
    cfg = load_model_config(path)
    dtype = resolve_dtype(args.dtype, cfg)
    max_model_len = resolve_max_model_len(cfg, args.max_model_len)
    spec = SpeculativeConfig.parse(args.speculative_config)
    draft = None
    if spec is not None and spec.method == "draft_model":
        from kvflow.spec_decode.draft_model import draft_model_config

        draft = draft_model_config(spec, cfg, max_model_len)[1]
    quantization = resolve_quantization(path, args.quantization, args.quantization_group_size,
                                        args.quantize_lm_head, args.dtype)
    plan = plan_kv_cache(cfg, dtype, args.block_size, max_model_len, kv_cache_memory=args.kv_cache_memory,
                         memory_utilization=args.memory_utilization, draft=draft, quantization=quantization,
                         kv_cache_dtype=args.kv_cache_dtype)
    print(f"model: {path} ({cfg.architecture}, {cfg.num_parameters() / 1e9:.2f} B parameters)")
    print(plan.describe())
    return 0


# ---- bench ----------------------------------------------------------------------------------
def register_bench(sub: argparse._SubParsersAction) -> None:
    """`kvflow bench {throughput,prefix,latency,speculative,quality,serve,router,roofline}`; each module defers its heavy imports to its run()."""
    from kvflow.bench import latency, prefix, quality, roofline, router, serve, speculative, throughput

    p = sub.add_parser("bench", help="benchmarks: throughput, prefix, latency, speculative, quality, serve, router, roofline")
    kinds = p.add_subparsers(dest="bench_command", metavar="BENCH")
    # (name, module, help, whether it builds an engine here and so takes the engine options)
    benches = [
        ("throughput", throughput, "offline throughput (W-offline by default), optionally vs transformers", True),
        ("prefix", prefix, "W-prefix: a shared system prompt, prefix caching off vs on in one run", True),
        ("latency", latency, "one request at a time: TTFT and inter-token latency (W-latency)", True),
        ("speculative", speculative, "the same requests with and without --speculative-config, in one run", True),
        ("quality", quality, "perplexity and top-1 agreement of quantization modes on a shipped text", True),
        ("serve", serve, "load-test an OpenAI-compatible server (Poisson arrivals, streaming)", False),
        ("router", router, "prefill tokens behind kvflow router: cache-aware vs round-robin over fresh instances",
         False),
        ("roofline", roofline, "this machine's matmul/bandwidth ceilings and a result's fraction of them", False),
    ]
    for name, module, help_text, runs_engine in benches:
        b = kinds.add_parser(name, help=help_text)
        if runs_engine:
            add_model_args(b)
            add_runtime_args(b)
            b.set_defaults(func=lambda args, m=module: m.run(engine_config_from_args(args), args) and 0)
        else:
            b.set_defaults(func=lambda args, m=module: m.run(args) and 0)
        module.add_arguments(b)
    p.set_defaults(func=lambda args: p.print_help() or 2)


# ---- entry point ----------------------------------------------------------------------------
def register_router_command(sub: argparse._SubParsersAction) -> None:
    from kvflow.entrypoints.router import register_router

    register_router(sub)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    register_serve, register_generate, register_chat, register_plan, register_bench, register_router_command,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow: LLM inference on the CPU")
    parser.add_argument("--log-level", default=None, help="python logging level (default: INFO for serve)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in SUBCOMMANDS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    level = args.log_level or ("INFO" if args.command in ("serve", "router") else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except ValueError as exc:  # bad options or model: one line, not a traceback
        print(f"kvflow {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
