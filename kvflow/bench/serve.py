"""`kvflow bench serve`: load-test any OpenAI-compatible server from the client side.

Requests arrive as a Poisson process at `--request-rate` (exponential gaps from a seeded
rng; `inf` sends them all at once), optionally capped at `--max-concurrency` in flight, and
each one streams so that TTFT, ITL, TPOT and E2E come from the client's own clock
(`serve_client`). `--sweep` repeats the run at several rates and plots latency against the
throughput achieved (`serve_plot`).

Honesty: a server with prefix caching answers a prompt it has seen from its cache, so the
warm-up uses its own draw and every run of a sweep gets a fresh draw (`--dataset-seed` + run
index); no prompt is ever timed twice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvflow.bench.machine import machine_info
from kvflow.bench.datasets import parse_token_range, random_requests
from kvflow.bench.serve_client import (RequestRecord, ServeRequest, completion_payload, first_model, httpx,
                                       send_request)
from kvflow.bench.serve_report import ServeRunResult, format_run, format_sweep, summarize_run


@dataclass
class ServeConfig:
    """Where and how to send: everything but the request list and the rate."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    max_concurrency: int | None = None
    logprobs: int | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float = 3600.0
    arrival_seed: int = 0
    progress: bool = True
    save_itls: bool = False

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/completions"


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"request rate must be positive or inf, got {text!r}")
    return rate


def parse_rates(text: str) -> list[float]:
    rates = [parse_rate(t) for t in text.split(",") if t.strip()]
    if not rates:
        raise ValueError(f"--sweep: no rates in {text!r}")
    return rates


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (s from the start) of a Poisson process: exponential gaps, first request at 0."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


def build_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                   token_range: tuple[int, int], tokenizer=None, as_text: bool = False) -> list[ServeRequest]:
    """Random token-id prompts (W-offline's draw for seed 0), or the same ids as text for servers that want text."""
    out = []
    for req in random_requests(num, input_len, output_len, seed, token_range):
        ids = req.prompt_token_ids
        prompt: list[int] | str = ids
        if as_text:
            # Without a tokenizer the ids become words; the server's usage report then gives the true length.
            prompt = tokenizer.decode(ids) if tokenizer is not None else " ".join(f"w{t}" for t in ids)
        out.append(ServeRequest(prompt, len(ids), req.output_len))
    return out


def _client(cfg: ServeConfig, num_requests: int) -> "httpx.AsyncClient":
    """One connection per request that may be in flight, so the pool never queues a request."""
    conns = cfg.max_concurrency or num_requests
    limits = httpx.Limits(max_connections=max(conns, 1), max_keepalive_connections=max(conns, 1))
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), limits=limits)


async def _warm_up(cfg: ServeConfig, model: str, requests: list[ServeRequest]) -> None:
    async with _client(cfg, 1) as client:
        for req in requests:
            rec = await send_request(client, cfg.url, completion_payload(req, model, cfg.logprobs), cfg.headers)
            if rec.error:
                raise ValueError(f"warm-up request failed: {rec.error}")


async def _run_rate(cfg: ServeConfig, model: str, requests: list[ServeRequest], rate: float) -> ServeRunResult:
    offsets = arrival_offsets(len(requests), rate, cfg.arrival_seed)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=f"rate {rate}/s", dynamic_ncols=True)
    async with _client(cfg, len(requests)) as client:
        start = time.perf_counter()

        async def one(req: ServeRequest, offset: float) -> RequestRecord:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            payload = completion_payload(req, model, cfg.logprobs)
            if limit is None:
                rec = await send_request(client, cfg.url, payload, cfg.headers)
            else:
                async with limit:
                    rec = await send_request(client, cfg.url, payload, cfg.headers)
            if not isinstance(req.prompt, list) and rec.prompt_tokens == 0:
                rec.prompt_tokens = req.prompt_len
            if bar is not None:
                bar.update(1)
            return rec

        records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return summarize_run(list(records), duration, rate, cfg.max_concurrency, cfg.slo_ttft_ms, cfg.slo_tpot_ms,
                         cfg.save_itls)


async def run_benchmark(cfg: ServeConfig, rates: list[float], make_requests, warmup: list[ServeRequest]
                        ) -> tuple[str, list[ServeRunResult]]:
    """Warm up once, then one run per rate, each on its own draw `make_requests(run_index)`."""
    model = cfg.model
    if model is None:
        async with _client(cfg, 1) as client:
            model = await first_model(client, cfg.base_url, cfg.headers)
    await _warm_up(cfg, model, warmup)
    results = []
    for i, rate in enumerate(rates):
        results.append(await _run_rate(cfg, model, make_requests(i), rate))
    return model, results


def _json_safe(value):
    """Strict JSON has no Infinity: an infinite rate is written as "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (no /v1)")
    g.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("KVFLOW_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY, else $KVFLOW_API_KEY)")
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=parse_rate, default=math.inf,
                   help="Poisson arrivals per second (inf: all at once)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many in flight; the others wait client-side and are timed from their send")
    g.add_argument("--sweep", type=parse_rates, default=None,
                   help="comma list of rates, e.g. 0.5,1,2,inf (overrides --request-rate)")
    g.add_argument("--arrival-seed", type=int, default=0, help="rng of the arrival times")
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--input-len-min", type=int, default=32)
    g.add_argument("--input-len-max", type=int, default=512)
    g.add_argument("--output-len-min", type=int, default=32)
    g.add_argument("--output-len-max", type=int, default=256)
    g.add_argument("--token-range", type=parse_token_range, default=(1000, 40000),
                   help="LOW,HIGH token ids of the random prompts (must fit the server's vocabulary)")
    g.add_argument("--dataset-seed", type=int, default=0, help="draw of the first run; run i of a sweep uses seed + i")
    g.add_argument("--warmup-seed", type=int, default=100, help="draw of the warm-up requests (must differ)")
    g.add_argument("--num-warmups", type=int, default=1, help="warm-up requests before timing (0: none)")
    g.add_argument("--prompt-text", action="store_true", help="send prompts as text (servers refusing token ids)")
    g.add_argument("--tokenizer", default=None, help="with --prompt-text: decode the drawn ids with this tokenizer")
    g.add_argument("--logprobs", type=int, default=None,
                   help="ask for N logprobs: makes servers send one chunk per token (needed for token-id-only models)")
    g = parser.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    g.add_argument("--output", help="write every run as JSON here")
    g.add_argument("--plot", default=None, help="with --sweep: PNG path (default serve-sweep.png)")
    g.add_argument("--save-detailed", action="store_true", help="keep every request's ITLs in the JSON")
    g.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> list[ServeRunResult]:
    rates = args.sweep or [args.request_rate]
    run_seeds = [args.dataset_seed + i for i in range(len(rates))]
    if args.num_warmups and args.warmup_seed in run_seeds:
        raise ValueError("--warmup-seed must differ from the seeds of the timed runs (warm-up must not see them)")
    tokenizer = None
    if args.tokenizer:
        from kvflow.loader.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    shape = ((args.input_len_min, args.input_len_max), (args.output_len_min, args.output_len_max))

    def make(num: int, seed: int) -> list[ServeRequest]:
        return build_requests(num, *shape, seed, args.token_range, tokenizer, args.prompt_text)

    cfg = ServeConfig(args.base_url, args.model, args.api_key, args.max_concurrency, args.logprobs, args.slo_ttft_ms,
                      args.slo_tpot_ms, args.timeout, args.arrival_seed, not args.no_progress, args.save_detailed)
    warmup = make(args.num_warmups, args.warmup_seed) if args.num_warmups > 0 else []
    model, results = asyncio.run(run_benchmark(cfg, rates, lambda i: make(args.num_prompts, run_seeds[i]), warmup))
    for r in results:
        print(format_run(r))
    plot = None
    if args.sweep:
        print(format_sweep(results))
        from kvflow.bench.serve_plot import plot_sweep

        plot = plot_sweep(results, args.plot or "serve-sweep.png", f"{model} at {args.base_url}")
        print(f"plot: {plot}")
    if args.output:
        report = {"kind": "serve", "base_url": args.base_url, "model": model, "plot": plot,
                  "runs": [r.to_dict() for r in results], "run_seeds": run_seeds,
                  "args": _json_safe({k: v for k, v in vars(args).items() if k not in ("api_key", "func")}),
                  "machine": asdict(machine_info())}
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return results
