"""`kvflow bench prefix`: W-prefix with prefix caching on and off, in one process.

32 requests share a 1,024-token system prompt and differ in a 64-token suffix. Both engines
warm up on another draw (another shared prefix), then time the same fresh draw, so what
the cached engine saves is sharing *within* the workload, never a repeat of seen prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from kvflow.bench.args import at_least
from kvflow.bench.datasets import WORKLOAD_TOKEN_RANGE, fit_token_range, prefix_requests
from kvflow.bench.throughput import ThroughputResult, run_kvflow


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload (defaults: W-prefix)")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--prefix-len", type=int, default=1024)
    g.add_argument("--suffix-len", type=int, default=64)
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--dataset-seed", type=int, default=2, help="prefix from default_rng(seed), suffixes from seed+1")
    g.add_argument("--warmup-seed", type=int, default=100)
    g.add_argument("--output", help="write both results and the ratios as JSON here")


def check_arguments(args: argparse.Namespace) -> None:
    at_least(args, 1, "num_prompts", "prefix_len", "output_len")
    at_least(args, 0, "suffix_len")
    if not args.enable_prefix_caching:
        raise ValueError("bench prefix runs with prefix caching off, then on, by design: leave out "
                         "--no-enable-prefix-caching")


def prefill_tokens_computed(result: ThroughputResult) -> int:
    """Tokens the model computed minus the decode steps (each request feeds back output_len - 1)."""
    return result.computed_tokens - (result.output_tokens - result.num_requests)


def run(config, args: argparse.Namespace) -> dict:
    from kvflow.engine.llm_engine import LLMEngine

    from kvflow.loader import load_model_config, resolve_model_path

    vocab_size = load_model_config(resolve_model_path(config.model)).vocab_size
    token_range = fit_token_range(WORKLOAD_TOKEN_RANGE, vocab_size)

    def requests(seed: int):
        return prefix_requests(args.num_prompts, args.prefix_len, args.suffix_len, args.output_len, seed, token_range)

    results: dict[str, ThroughputResult] = {}
    for caching in (False, True):
        label = "prefix caching " + ("on" if caching else "off")
        engine = LLMEngine(dataclasses.replace(config, enable_prefix_caching=caching))
        run_kvflow(engine, requests(args.warmup_seed))
        results[label] = run_kvflow(engine, requests(args.dataset_seed), label=label)
        print(results[label].summary())
        del engine
    off, on = results["prefix caching off"], results["prefix caching on"]
    prefill = {k: prefill_tokens_computed(v) for k, v in results.items()}
    ratios = {
        "prefill_tokens_off_over_on": prefill["prefix caching off"] / max(prefill["prefix caching on"], 1),
        "computed_tokens_off_over_on": off.computed_tokens / max(on.computed_tokens, 1),
        "mean_ttft_off_over_on": off.mean_ttft_s / max(on.mean_ttft_s, 1e-9),
        "wall_off_over_on": off.wall_s / on.wall_s,
    }
    print(
        f"prefill tokens computed: {prefill['prefix caching off']} off, {prefill['prefix caching on']} on\n"
        f"prefix caching cuts prefill work {ratios['prefill_tokens_off_over_on']:.1f}x "
        f"(all tokens computed {ratios['computed_tokens_off_over_on']:.1f}x), "
        f"mean TTFT {ratios['mean_ttft_off_over_on']:.1f}x, wall time {ratios['wall_off_over_on']:.1f}x"
    )
    report = {"results": {k: dataclasses.asdict(v) for k, v in results.items()}, "prefill_tokens": prefill,
              "ratios": ratios, "args": vars(args)}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return report
