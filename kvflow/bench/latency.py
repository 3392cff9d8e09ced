"""`kvflow bench latency`: one request at a time (W-latency), TTFT and inter-token latency.

Each iteration sends one greedy `ignore_eos` request and times, on the caller's clock, the
arrival of every token out of `LLMEngine.step()`. Every iteration gets its own fresh prompt
from one rng stream (`default_rng(1)` by default, so the first timed prompt is exactly
W-latency's), and the warm-up uses a different rng: a repeated prompt would be answered
from the prefix cache and make TTFT look far better than any user would see. The prefix
cache hits of every timed request are recorded, so a violation would show in the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvflow.bench.args import at_least
from kvflow.bench.machine import machine_info
from kvflow.bench.datasets import WORKLOAD_TOKEN_RANGE, fit_token_range, grounded_requests
from kvflow.bench.metrics import Percentiles, percentiles, request_latency
from kvflow.bench.results import current_rss_mb, numerics_label, peak_rss_mb


@dataclass
class Iteration:
    ttft_s: float
    mean_itl_s: float | None  # None with a single output token
    e2e_s: float
    output_tokens: int
    cached_prompt_tokens: int  # must be 0: the prompt was never seen before


@dataclass
class LatencyResult:
    dtype: str
    input_len: int
    output_len: int
    num_threads: int
    iterations: list[Iteration]
    ttft: Percentiles
    itl: Percentiles
    peak_rss_mb: float  # the process's maximum, loading included (issue 12 compares weight formats by it)
    rss_mb: float  # resident at the end: what serving holds once loading's transients are gone

    def summary(self) -> str:
        t, i = self.ttft.scaled(1e3), self.itl.scaled(1e3)
        cached = sum(it.cached_prompt_tokens for it in self.iterations)
        lines = [
            f"latency ({self.dtype}, {self.num_threads} threads): {len(self.iterations)} iterations, one request "
            f"at a time, {self.input_len} prompt tokens -> {self.output_len} output tokens",
            f"  TTFT      median {t.p50:8.1f} ms   p90 {t.p90:8.1f} ms   mean {t.mean:8.1f} ms",
            f"  mean ITL  median {i.p50:8.2f} ms   p90 {i.p90:8.2f} ms   mean {i.mean:8.2f} ms",
            f"  peak RSS {self.peak_rss_mb:.0f} MB (loading included), RSS at the end {self.rss_mb:.0f} MB",
        ]
        if cached:
            lines.append(f"  WARNING: {cached} prompt tokens came from the prefix cache; "
                         "TTFT is not a cold-prompt figure")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ttft"], d["itl"] = self.ttft.to_dict(), self.itl.to_dict()
        return d


def time_one_request(engine, request_id: str, prompt: list[int], output_len: int, lora_request=None) -> Iteration:
    """Submit one request to an idle engine and time each token as `step()` hands it over."""
    from kvflow.sampling.params import SamplingParams

    if engine.has_unfinished_requests():
        raise RuntimeError("bench latency needs an idle engine")
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params, lora_request=lora_request)
    times: list[float] = []
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            times += [now] * max(len(out.new_token_ids), 1)
            cached = out.num_cached_tokens
    lat = request_latency(start, times)
    mean_itl = float(np.mean(lat.itls)) if lat.itls else None
    return Iteration(lat.ttft, mean_itl, lat.e2e, lat.output_tokens, cached)


def prompts(seed: int, count: int, length: int, token_range: tuple[int, int]) -> list[list[int]]:
    """`count` prompts drawn one after another from one rng: the first is W-latency's for seed 1."""
    rng = np.random.default_rng(seed)
    return [rng.integers(token_range[0], token_range[1], size=length).tolist() for _ in range(count)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (W-latency: 128)")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens (W-latency: 128)")
    g.add_argument("--dataset", choices=["random", "grounded"], default="random",
                   help="random: W-latency's ids of --input-len; grounded: W-grounded chat prompts (own lengths)")
    g.add_argument("--num-iters", type=int, default=5, help="timed requests, each with a fresh prompt")
    g.add_argument("--num-iters-warmup", type=int, default=1, help="warm-up requests (from --warmup-seed)")
    g.add_argument("--dataset-seed", type=int, default=1, help="rng of the timed prompts (W-latency: 1)")
    g.add_argument("--warmup-seed", type=int, default=101, help="rng of the warm-up prompts (must differ)")
    g.add_argument("--lora-path", default=None, metavar="PATH",
                   help="run every request with this PEFT LoRA adapter (turns on --enable-lora; ranks above 16 "
                        "need --max-lora-rank)")
    g.add_argument("--output", help="write the result as JSON here")


def check_arguments(args: argparse.Namespace) -> None:
    if args.warmup_seed == args.dataset_seed:
        raise ValueError("--warmup-seed must differ from --dataset-seed (warm-up must not see the timed prompts)")
    at_least(args, 1, "num_iters", "input_len", "output_len")
    at_least(args, 0, "num_iters_warmup")


def run(config, args: argparse.Namespace) -> LatencyResult:
    import torch

    from kvflow.engine.llm_engine import LLMEngine

    check_arguments(args)
    lora = None
    if args.lora_path is not None:
        from kvflow.lora.request import LoRARequest

        config.enable_lora, lora = True, LoRARequest("bench", 1, args.lora_path)
    engine = LLMEngine(config)
    token_range = fit_token_range(WORKLOAD_TOKEN_RANGE, engine.model_config.vocab_size)
    if args.dataset == "grounded":
        grounded = grounded_requests(engine.tokenizer, args.num_iters, args.dataset_seed, args.output_len)
        timed = [r.prompt_token_ids for r in grounded]
        warmup = [r.prompt_token_ids for r in grounded_requests(
            engine.tokenizer, args.num_iters_warmup, args.warmup_seed, args.output_len, exclude=grounded)]
    else:
        timed = prompts(args.dataset_seed, args.num_iters, args.input_len, token_range)
        warmup = prompts(args.warmup_seed, args.num_iters_warmup, args.input_len, token_range)
    longest = max(map(len, timed + warmup)) + args.output_len
    if longest > engine.max_model_len:  # the engine would cut the output short, and the ITL would count fewer tokens
        raise ValueError(f"a prompt and its --output-len {args.output_len} take {longest} tokens, more than "
                         f"max_model_len {engine.max_model_len}")
    seen = {tuple(p) for p in timed}
    for i, prompt in enumerate(warmup):
        if tuple(prompt) in seen:
            raise RuntimeError("a warm-up prompt equals a timed prompt; choose another --warmup-seed")
        time_one_request(engine, f"latency-warmup-{i}", prompt, args.output_len, lora)
    spec0 = engine.get_stats().spec_decode
    iterations = [time_one_request(engine, f"latency-{i}", p, args.output_len, lora) for i, p in enumerate(timed)]
    result = LatencyResult(
        dtype=numerics_label(engine), output_len=args.output_len,
        input_len=args.input_len if args.dataset == "random" else round(sum(map(len, timed)) / len(timed)),
        num_threads=torch.get_num_threads(), iterations=iterations,
        ttft=percentiles(it.ttft_s for it in iterations), itl=percentiles(it.mean_itl_s for it in iterations),
        peak_rss_mb=peak_rss_mb(), rss_mb=current_rss_mb(),
    )
    print(result.summary())
    print("  machine: " + machine_info().describe())
    if spec0 is not None:
        print("  " + engine.get_stats().spec_decode.since(spec0).describe())
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"kind": "latency", "result": result.to_dict(), "args": vars(args),
                       "machine": asdict(machine_info())}, f, indent=2, default=str)
    return result
