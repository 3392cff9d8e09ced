"""`kvflow bench throughput`: offline throughput on a fixed request set.

All requests are submitted at once and the engine steps until the last token; wall time
runs from submission to that token. Output lengths are exact (`ignore_eos`). A warm-up
pass on a *different* draw of the same shapes comes first, so the timed prompts are never
served from the prefix cache.

`--baseline hf` then runs the identical request list through transformers (see
`hf_baseline`) in the same process, with the same dtype and threads, and prints
kvflow/baseline ratios from that one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict

from kvflow.bench.args import at_least, ordered
from kvflow.bench.machine import machine_info
from kvflow.bench.datasets import (WORKLOAD_TOKEN_RANGE, BenchRequest, fit_token_range, grounded_requests, jsonl_requests,
                                   prefix_requests, random_like, random_requests)
from kvflow.bench.hf_baseline import run_baseline
from kvflow.bench.results import ThroughputResult, current_rss_mb, numerics_label, peak_rss_mb


# `--structured-output json`: every request carries this schema. A list of at least 256 strings
# (each at least 3 tokens), so that outputs run to their max_tokens (at most 256) like the
# unconstrained ones, since ignore_eos cannot outlast a complete grammar, and both runs time
# the same tokens. (With no minimum, greedy on the random prompts wrote `[]` and stopped.)
STRUCTURED_SCHEMAS = {"json": {"type": "array", "items": {"type": "string"}, "minItems": 256}}


def run_kvflow(engine, requests: list[BenchRequest], use_tqdm: bool = False, label: str = "kvflow",
               structured_output: str | None = None) -> ThroughputResult:
    """Submit everything at once, step to the end, and measure."""
    from kvflow.sampling.params import SamplingParams
    from kvflow.structured_output.params import StructuredOutputsParams

    so = StructuredOutputsParams(json=STRUCTURED_SCHEMAS[structured_output]) if structured_output else None
    stats0 = engine.get_stats()
    start = time.perf_counter()
    t0 = time.time()
    for i, req in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=True, structured_outputs=so)
        engine.add_request(f"bench-{t0}-{i}", {"prompt_token_ids": req.prompt_token_ids}, params, arrival_time=t0)
    bar = None
    if use_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=sum(r.output_len for r in requests), desc="output tokens", dynamic_ncols=True)
    peak_kv, ttfts = 0.0, []
    engine.step_shapes = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        peak_kv = max(peak_kv, engine.kv_cache_manager.usage)
        for out in outputs:
            if len(out.outputs[0].token_ids) == 1:
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        if bar is not None:
            bar.update(len(outputs))
    wall = time.perf_counter() - start
    steps, engine.step_shapes = [shape.as_list() for shape in engine.step_shapes], None
    if bar is not None:
        bar.close()
    stats = engine.get_stats()
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    output = stats.generation_tokens - stats0.generation_tokens  # all of output_len, unless a grammar ended early
    return ThroughputResult(
        engine=label,
        dtype=numerics_label(engine),
        num_requests=len(requests),
        prompt_tokens=prompt,
        output_tokens=output,
        wall_s=wall,
        requests_per_s=len(requests) / wall,
        total_tokens_per_s=(prompt + output) / wall,
        output_tokens_per_s=output / wall,
        peak_rss_mb=peak_rss_mb(),
        peak_kv_usage=peak_kv,
        preemptions=stats.num_preemptions - stats0.num_preemptions,
        computed_tokens=stats.computed_tokens - stats0.computed_tokens,
        mean_ttft_s=sum(ttfts) / max(len(ttfts), 1),
        spec_decode=stats.spec_decode.since(stats0.spec_decode).describe() if stats.spec_decode else None,
        steps=steps,
    )


def build_requests(args: argparse.Namespace, seed: int, tokenizer=None,
                   vocab_size: int | None = None) -> list[BenchRequest]:
    """The request set; token ids stay in [1000, 40000) unless the model's vocabulary is smaller."""
    token_range = WORKLOAD_TOKEN_RANGE if vocab_size is None else fit_token_range(WORKLOAD_TOKEN_RANGE, vocab_size)
    if args.dataset == "random":
        return random_requests(args.num_prompts, (args.input_len_min, args.input_len_max),
                               (args.output_len_min, args.output_len_max), seed, token_range)
    if args.dataset == "prefix":
        return prefix_requests(args.num_prompts, args.prefix_len, args.suffix_len, args.output_len_max, seed,
                               token_range)
    if args.dataset == "grounded":
        return grounded_requests(tokenizer, args.num_prompts, seed, args.output_len_max)
    return jsonl_requests(args.dataset_path, tokenizer, args.output_len_max)


def warmup_requests(args: argparse.Namespace, timed: list[BenchRequest], tokenizer=None,
                    vocab_size: int | None = None) -> list[BenchRequest]:
    """A different draw for warm-up: never the timed prompts, which the prefix cache would then serve.

    A JSONL file has no second draw, so its warm-up is random ids of the same lengths.
    """
    if args.dataset == "grounded":  # another draw that shares no passage with the timed set
        return grounded_requests(tokenizer, args.num_prompts, args.warmup_seed, args.output_len_max, exclude=timed)
    if args.dataset != "jsonl":
        return build_requests(args, args.warmup_seed, tokenizer, vocab_size)
    token_range = WORKLOAD_TOKEN_RANGE if vocab_size is None else fit_token_range(WORKLOAD_TOKEN_RANGE, vocab_size)
    return random_like(timed, args.warmup_seed, token_range)


def ratios(ours: ThroughputResult, base: ThroughputResult) -> dict[str, float]:
    """kvflow / baseline: above 1 is better for rates; below 1 is better for wall time."""
    return {
        "total_tokens_per_s": ours.total_tokens_per_s / base.total_tokens_per_s,
        "output_tokens_per_s": ours.output_tokens_per_s / base.output_tokens_per_s,
        "wall_s": ours.wall_s / base.wall_s,
    }


def describe_ratios(r: dict[str, float], baseline: str) -> str:
    return (f"kvflow / {baseline} (same run): total tok/s x{r['total_tokens_per_s']:.2f}, "
            f"output tok/s x{r['output_tokens_per_s']:.2f}, wall x{r['wall_s']:.2f} (below 1 = kvflow faster)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Workload options; engine options come from the CLI's shared groups."""
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", choices=["random", "prefix", "jsonl", "grounded"], default="random")
    g.add_argument("--dataset-path", help="for --dataset jsonl")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--input-len-min", type=int, default=32)
    g.add_argument("--input-len-max", type=int, default=512)
    g.add_argument("--output-len-min", type=int, default=32)
    g.add_argument("--output-len-max", type=int, default=256)
    g.add_argument("--prefix-len", type=int, default=1024)
    g.add_argument("--suffix-len", type=int, default=64)
    g.add_argument("--dataset-seed", type=int, default=0, help="dataset draw (W-offline: 0)")
    g.add_argument("--warmup-seed", type=int, default=100, help="a different draw for warm-up; -1 to skip")
    g.add_argument("--output", help="write the result as JSON here")
    g.add_argument("--baseline", choices=["hf"], default=None,
                   help="also run the same requests through transformers generate() and print the ratios")
    g.add_argument("--baseline-batch-size", type=int, default=16, help="static batch size of the hf baseline")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--structured-output", choices=sorted(STRUCTURED_SCHEMAS), default=None,
                   help="every request carries this constraint (json: a JSON schema, STRUCTURED_SCHEMAS): "
                        "the cost of structured output")
    g.add_argument("--repeat", type=int, default=1,
                   help="time N runs in one process, each on a fresh draw (dataset seed + 1000*i), and report "
                        "each run's throughput and resident memory: steady state and leaks")


def check_arguments(args: argparse.Namespace) -> None:
    at_least(args, 1, "num_prompts", "repeat", "input_len_min", "output_len_min", "prefix_len", "baseline_batch_size")
    at_least(args, 0, "suffix_len")
    ordered(args, "input_len_min", "input_len_max")
    ordered(args, "output_len_min", "output_len_max")
    if args.dataset == "jsonl" and not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")


def run(config, args: argparse.Namespace) -> ThroughputResult:
    """Warm up on another draw of the same shapes, then time the requested one (then the baseline)."""
    from kvflow.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    requests = build_requests(args, args.dataset_seed, engine.tokenizer, vocab)
    warmup = warmup_requests(args, requests, engine.tokenizer, vocab) if args.warmup_seed >= 0 else None
    structured = getattr(args, "structured_output", None)
    if warmup:
        run_kvflow(engine, warmup, structured_output=structured)
    result = run_kvflow(engine, requests, use_tqdm=not args.no_progress, structured_output=structured)
    print(result.summary())
    print("  machine: " + machine_info().describe())
    report: dict = {"kind": "throughput", "result": asdict(result), "args": vars(args),
                    "machine": asdict(machine_info())}
    if args.repeat > 1:
        runs = [{"total_tokens_per_s": result.total_tokens_per_s, "rss_mb": current_rss_mb()}]
        for i in range(1, args.repeat):
            again = run_kvflow(engine, build_requests(args, args.dataset_seed + 1000 * i, engine.tokenizer, vocab),
                               structured_output=structured)
            runs.append({"total_tokens_per_s": again.total_tokens_per_s, "rss_mb": current_rss_mb()})
            print(f"run {i + 1}/{args.repeat}: {again.total_tokens_per_s:.1f} total tok/s, RSS {runs[-1]['rss_mb']:.0f} MB")
        rates = sorted(r["total_tokens_per_s"] for r in runs)
        print(f"{args.repeat} runs: median {rates[len(rates) // 2]:.1f} total tok/s; RSS after run 1 "
              f"{runs[0]['rss_mb']:.0f} MB, after run {args.repeat} {runs[-1]['rss_mb']:.0f} MB")
        report["repeats"] = runs
    if args.baseline == "hf":
        model_path, load_format, dtype = engine.model_path, config.load_format, engine.dtype
        del engine  # free kvflow's weights and KV cache before transformers loads its copy
        gc.collect()
        base, setup = run_baseline(model_path, load_format, dtype, requests, warmup, args.baseline_batch_size,
                                   use_tqdm=not args.no_progress)
        r = ratios(result, base)
        print(base.summary())
        print(setup.describe())
        print("(peak RSS is the process's maximum so far: the baseline runs after kvflow in the same process)")
        print(describe_ratios(r, "hf"))
        report.update(baseline=asdict(base), baseline_setup=asdict(setup), ratios=r)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return result
