"""The `kvflow` command: serve, generate, chat, plan and bench.

Each subcommand registers itself from one `register_*` function listed in `SUBCOMMANDS`, so
a new one (say `bench`) is one function and one list entry; engine options are shared by
`add_model_args` / `add_runtime_args` (cli_args.py) so every subcommand spells them the same way.
generate and chat live in cli_chat.py, plan in cli_plan.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Callable

from kvflow.entrypoints.cli_args import (UVICORN_LOG_LEVELS, add_model_args, add_runtime_args,
                                         engine_config_from_args, parse_bytes)
from kvflow.entrypoints.cli_chat import register_chat, register_generate
from kvflow.entrypoints.cli_plan import register_plan

if TYPE_CHECKING:
    from kvflow.config import EngineConfig

logger = logging.getLogger("kvflow")

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


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
                        "(a decode instance; kv_timeout_s, default 60: how long it waits for them, the prefill included, "
                        "before computing the rest of the prompt "
                        "itself); see kvflow router --prefill/--decode")
    g.add_argument("--in-process-engine", action="store_true",
                   help="run the engine loop in the API server's process (a thread) instead of its own engine "
                        "core process")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto' (the default with tools): the model decides whether to call, "
                        "and --tool-call-parser reads the calls it writes (refused otherwise)")
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the model's tool-call format: hermes (<tool_call> JSON blocks; Qwen2.5, Qwen3), "
                        "llama3_json (JSON calls; Llama 3.1-3.3) or mistral ([TOOL_CALLS]; Mistral)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served under their own model names (needs --enable-lora); also vLLM's "
                        "JSON form '{\"name\": ..., \"path\": ...}'")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    g.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from kvflow.entrypoints.async_engine import AsyncEngine
    from kvflow.entrypoints.openai.lifecycle import bind_socket

    if args.shutdown_timeout < 0:  # before the weights load
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.max_waiting is not None and args.max_waiting < -1:
        raise ValueError(f"--max-waiting must be >= 0, or -1 for no limit, got {args.max_waiting}")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: the parser reads the calls "
                         "the model chooses to make")
    if args.tool_call_parser is not None:
        from kvflow.entrypoints.openai.tool_parsers import make_tool_parser

        make_tool_parser(args.tool_call_parser)  # an unknown name fails here, before the weights load
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    if args.lora_modules:
        from kvflow.entrypoints.openai.adapters import ServedModels

        ServedModels.from_specs("", args.lora_modules)  # a bad entry or folder fails here, before the weights load
    max_waiting = args.max_num_seqs if args.max_waiting is None else args.max_waiting
    kv_transfer = None
    if args.kv_transfer_config is not None:  # checked before the weights load
        from kvflow.distributed.kv_transfer.config import KVTransferConfig

        kv_transfer = KVTransferConfig.parse(args.kv_transfer_config)
        if not args.enable_prefix_caching:
            raise ValueError("--kv-transfer-config needs prefix caching: transferred blocks enter the prefix cache")
    engine_class = AsyncEngine
    if not args.in_process_engine:  # the engine loop in its own process, over ZMQ (entrypoints/core/)
        from kvflow.entrypoints.core.client import EngineCoreClient as engine_class
    config = engine_config_from_args(args)
    sock = bind_socket(args.host, args.port)  # after the option checks, before the weights load
    try:
        return _serve(args, engine_class, config, max_waiting, kv_transfer, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, engine_class: type, config: EngineConfig, max_waiting: int, kv_transfer,
           sock) -> int:
    """Load the engine and serve on `sock` until drained (run_serve has checked every option)."""
    from kvflow.entrypoints.openai.lifecycle import serve_until_drained
    from kvflow.entrypoints.openai.server import build_app

    engine = engine_class.from_config(config, max_waiting=None if max_waiting < 0 else max_waiting,
                                      kv_transfer_config=kv_transfer)
    if not args.in_process_engine:
        logger.info("engine core: process %d (the API server tokenizes and streams; --in-process-engine for one "
                    "process)", engine.core_pid)
    logger.info("admission: at most %s request(s) waiting for a batch slot (--max-waiting), then 503; SIGTERM drains for at most "
                "%g s (--shutdown-timeout)", max_waiting if max_waiting >= 0 else "unlimited", args.shutdown_timeout)
    name = args.served_model_name or args.model or DEFAULT_SERVED_NAME
    app = build_app(engine, name, args.api_key, max_request_bytes=args.max_request_bytes,
                    tool_call_parser=args.tool_call_parser, lora_modules=args.lora_modules,
                    allow_runtime_lora_updating=args.allow_runtime_lora_updating)
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
        return serve_until_drained(app, engine, sock, args.uvicorn_log_level, args.shutdown_timeout)
    finally:
        engine.shutdown()


# ---- bench ----------------------------------------------------------------------------------
def register_bench(sub: argparse._SubParsersAction) -> None:
    """`kvflow bench {throughput,prefix,latency,speculative,quality,embed,serve,router,disagg,roofline,collectives}`;
    each module defers its heavy imports to its run()."""
    from kvflow.bench import (collectives, disagg, embed, latency, prefix, quality, roofline, router, serve,
                              speculative, throughput)

    p = sub.add_parser("bench", help="benchmarks: throughput, prefix, latency, speculative, quality, embed, serve, "
                                     "router, disagg, roofline, collectives")
    kinds = p.add_subparsers(dest="bench_command", metavar="BENCH")
    # (name, module, help, whether it builds an engine here and so takes the engine options)
    benches = [
        ("throughput", throughput, "offline throughput (W-offline by default), optionally vs transformers", True),
        ("prefix", prefix, "W-prefix: a shared system prompt, prefix caching off vs on in one run", True),
        ("latency", latency, "one request at a time: TTFT and inter-token latency (W-latency)", True),
        ("speculative", speculative, "the same requests with and without --speculative-config, in one run", True),
        ("quality", quality, "perplexity and top-1 agreement of quantization modes on a shipped text", True),
        ("embed", embed, "embedding throughput (W-embed), optionally vs transformers, with the vectors compared",
         True),
        ("serve", serve, "load-test an OpenAI-compatible server (Poisson arrivals, streaming)", False),
        ("router", router, "prefill tokens behind kvflow router: cache-aware vs round-robin over fresh instances",
         False),
        ("disagg", disagg, "decode streams' ITL while long prompts arrive: colocated vs prefill + decode instances",
         False),
        ("roofline", roofline, "this machine's matmul/bandwidth ceilings and a result's fraction of them", False),
        ("collectives", collectives, "µs per gloo all-reduce and stage-to-stage send at decode/prefill sizes", False),
    ]
    for name, module, help_text, runs_engine in benches:
        b = kinds.add_parser(name, help=help_text)
        if runs_engine:
            add_model_args(b)
            add_runtime_args(b)
        b.set_defaults(func=lambda args, m=module, e=runs_engine: _run_bench(m, args, e))
        module.add_arguments(b)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _run_bench(module, args: argparse.Namespace, runs_engine: bool) -> int:
    """Check the bench's files and its own options (its `check_arguments`, where it has one)
    before any model loads, then run it."""
    from kvflow.bench.args import check_paths

    check_paths(args)
    if hasattr(module, "check_arguments"):
        module.check_arguments(args)
    if runs_engine:
        module.run(engine_config_from_args(args), args)
    else:
        module.run(args)
    return 0


# ---- entry point ----------------------------------------------------------------------------
def register_router_command(sub: argparse._SubParsersAction) -> None:
    from kvflow.entrypoints.router import register_router

    register_router(sub)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    register_serve, register_generate, register_chat, register_plan, register_bench, register_router_command,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow: LLM inference on the CPU")
    parser.add_argument("--log-level", default=None, type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                        help="python logging level (default: INFO for serve and router, else WARNING)")
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
    except OSError as exc:  # a file that is missing or cannot be written
        print(f"kvflow {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
