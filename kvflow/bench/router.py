"""`kvflow bench router`: prefill tokens computed behind `kvflow router`, cache-aware vs round-robin.

W-prefix-shaped traffic for data parallelism: `--num-prefixes` system prompts (each like
W-prefix's: `--prefix-len` tokens from default_rng(seed + k), a `--suffix-len` suffix per request),
`--num-prompts` requests in a shuffled order of groups, sent `--max-concurrency` at a time through
a router over `--instances` fresh `kvflow serve` processes. For each policy the instances are
started anew (empty caches), and what is reported is the sum over instances of
`kvflow:prefill_tokens_total`: prompt positions the models computed, prefix-cache hits excluded.
Round-robin makes every instance see every prefix, so each caches all of them (or thrashes when
they do not fit); cache-aware routing keeps each prefix on one instance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import threading
import time

import numpy as np

from kvflow.bench.instances import Instance, free_port, start_serve, wait_healthy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--instances", type=int, default=2)
    g.add_argument("--num-prefixes", type=int, default=8)
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--prefix-len", type=int, default=512)
    g.add_argument("--suffix-len", type=int, default=32)
    g.add_argument("--output-len", type=int, default=8)
    g.add_argument("--max-concurrency", type=int, default=4)
    g.add_argument("--dataset-seed", type=int, default=2)
    g.add_argument("--policies", default="round_robin,cache_aware")
    g.add_argument("--serve-args", default="--dtype float32 --kv-cache-memory 160MiB --max-model-len 1024",
                   help="options for each kvflow serve instance (the model's among them)")
    g.add_argument("--disaggregated", action="store_true",
                   help="instead: one kv_producer (prefill) and one kv_consumer (decode) instance behind "
                        "kvflow router --prefill/--decode; reports the KV bytes and time moved per request")
    g.add_argument("--output", help="write the results as JSON here")


def build_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    low, high = 1000, min(40000, vocab_size)
    prefixes = [np.random.default_rng(args.dataset_seed + k).integers(low, high, size=args.prefix_len).tolist()
                for k in range(args.num_prefixes)]
    rng = np.random.default_rng(args.dataset_seed + 1000)
    groups = rng.integers(0, args.num_prefixes, size=args.num_prompts)
    return [prefixes[g] + rng.integers(low, high, size=args.suffix_len).tolist() for g in groups]


def _start_instances(n: int, serve_args: list[str], disaggregated: bool = False) -> list[Instance]:
    roles = [{"kv_role": "kv_producer" if k == 0 else "kv_consumer"} if disaggregated else None for k in range(n)]
    return [start_serve(serve_args, role) for role in roles]


def _prefill_tokens(metrics_text: str) -> int:
    return int(sum(float(line.split()[-1]) for line in metrics_text.splitlines()
                   if line.startswith("kvflow:prefill_tokens_total")))


async def _drive(base_url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> float:
    from kvflow.entrypoints.router import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def one(prompt: list[int]) -> None:
            async with sem:
                r = await client.post("/v1/completions", json={"model": "bench", "prompt": prompt, "temperature": 0,
                                                                "max_tokens": output_len, "ignore_eos": True})
                r.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start


def run_policy(policy: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    import uvicorn

    from kvflow.entrypoints.router import Router, build_router_app, httpx

    n = 2 if args.disaggregated else args.instances
    instances = _start_instances(n, args.serve_args.split(), args.disaggregated)
    try:
        wait_healthy(instances, 600)
        urls = [url for _, url in instances]
        router = Router(urls[1:], policy, prefill_urls=urls[:1]) if args.disaggregated else Router(urls, policy)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(build_router_app(router), host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        if args.disaggregated:  # the router learns the producer's block address from its health check
            while not router.prefills[0].kv_addr:
                time.sleep(0.2)
        wall = asyncio.run(_drive(f"http://127.0.0.1:{port}", prompts, args.output_len, args.max_concurrency))
        per_instance = [_prefill_tokens(httpx.get(url + "/metrics").text) for _, url in instances]
        kv = httpx.get(urls[-1] + "/kv_transfer").json()["stats"] if args.disaggregated else None
        server.should_exit = True
        thread.join(10)
        return {"policy": policy, "kv_transfer": kv, "disaggregated": dict(router.disaggregated), "prefill_tokens": sum(per_instance), "per_instance": per_instance,
                "requests_per_instance": [i.requests_total for i in router.instances], "wall_s": wall,
                "decisions": dict(router.routed)}
    finally:
        for proc, _ in instances:
            proc.terminate()
        for proc, _ in instances:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def run(args: argparse.Namespace) -> dict:
    from kvflow.loader import load_model_config, resolve_model_path

    serve = args.serve_args.split()
    model = serve[serve.index("--model") + 1] if "--model" in serve else None
    prompts = build_prompts(args, load_model_config(resolve_model_path(model)).vocab_size)
    prompt_tokens = sum(len(p) for p in prompts)
    results = {}
    for policy in args.policies.split(","):
        results[policy] = run_policy(policy, args, prompts)
        r = results[policy]
        print(f"{policy}: prefill tokens computed {r['prefill_tokens']:,} of {prompt_tokens:,} prompt tokens "
              f"(per instance {r['per_instance']}, requests {r['requests_per_instance']}), {r['wall_s']:.1f} s")
        kv = r["kv_transfer"]
        if kv:
            per = max(kv["requests"], 1)
            print(f"  KV moved to the decode instance: {kv['blocks']} blocks, {kv['bytes'] / per / 1e6:.2f} MB and "
                  f"{kv['seconds'] / per * 1e3:.1f} ms per request ({kv['requests']} requests, {kv['failures']} "
                  f"failed); prefills {r['disaggregated']}")
    report = {"kind": "router", "prompt_tokens": prompt_tokens, "results": results, "args": vars(args)}
    if "round_robin" in results and "cache_aware" in results:
        ratio = results["round_robin"]["prefill_tokens"] / max(results["cache_aware"]["prefill_tokens"], 1)
        report["round_robin_over_cache_aware"] = ratio
        print(f"cache-aware routing computes {ratio:.2f}x fewer prefill tokens than round-robin")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return report
