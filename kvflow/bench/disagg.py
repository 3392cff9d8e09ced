"""`kvflow bench disagg`: decode streams' inter-token latency while long prompts arrive, colocated
vs one prefill + one decode instance (the issue's mixed workload for disaggregation).

`--num-streams` steady decode streams (short prompts, `--stream-output-len` tokens each, greedy,
`ignore_eos`, streamed) run; once every stream has its first token, `--num-long` prompts of
`--long-len` tokens arrive `--long-interval-s` apart (max_tokens `--long-output-len`). What is
reported is the ITL of the decode streams (p50/p90/p99, from the client's clock, over the tokens
that arrived while long prompts were in flight, and over the whole run), the long prompts' TTFT,
and, disaggregated, the KV the decode instance received per long prompt (bytes, wall ms from its
subscription to the last block, ms spent writing blocks).

- colocated: one `kvflow serve` on all of `--cpus` (num-threads = their count); streams and long
  prompts go to it.
- disaggregated: a kv_producer on the first of `--cpus` and a kv_consumer on the second (one
  thread each), behind `kvflow router --prefill/--decode` (in this process); the streams go to the
  decode instance directly, the long prompts through the router (their prefill on the producer,
  the KV streamed to the consumer as each prefill chunk completes).

Fresh instances per mode, so no prompt is ever a cache hit of the other mode's.
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
from kvflow.bench.serve_client import ServeRequest, completion_payload, httpx, send_request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-streams", type=int, default=4)
    g.add_argument("--stream-prompt-len", type=int, default=64)
    g.add_argument("--stream-output-len", type=int, default=256)
    g.add_argument("--num-long", type=int, default=6)
    g.add_argument("--long-len", type=int, default=2000)
    g.add_argument("--long-output-len", type=int, default=8)
    g.add_argument("--long-interval-s", type=float, default=3.0)
    g.add_argument("--dataset-seed", type=int, default=5)
    g.add_argument("--modes", default="colocated,disaggregated")
    g.add_argument("--cpus", default="0,1", help="cores (taskset): colocated uses all, disaggregated one each")
    g.add_argument("--serve-args", default="--max-model-len 4096",
                   help="options for each kvflow serve instance (the model's among them)")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    g.add_argument("--output", help="write the results as JSON here")


def _start(serve_args: list[str], cpus: str, threads: int, role: str | None) -> Instance:
    kv = {"kv_role": role, "kv_timeout_s": 120} if role is not None else None
    return start_serve(serve_args, kv, cpus=cpus, threads=threads)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "n": 0}
    a = np.asarray(values) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "n": len(values)}


async def _drive(args: argparse.Namespace, stream_url: str, long_url: str) -> dict:
    rng = np.random.default_rng(args.dataset_seed)
    draw = lambda n: rng.integers(1000, 20000, size=n).tolist()  # noqa: E731
    streams = [ServeRequest(draw(args.stream_prompt_len), args.stream_prompt_len, args.stream_output_len)
               for _ in range(args.num_streams)]
    longs = [ServeRequest(draw(args.long_len), args.long_len, args.long_output_len) for _ in range(args.num_long)]
    window: list[float] = []
    async with httpx.AsyncClient(timeout=3600) as client:
        stream_tasks = [asyncio.ensure_future(send_request(client, stream_url + "/v1/completions",
                                                           completion_payload(r, "bench"))) for r in streams]
        await asyncio.sleep(0)
        while len(window) == 0:  # every stream has started decoding: now the long prompts come
            await asyncio.sleep(0.05)
            probe = await client.get(stream_url + "/metrics")
            running = [float(line.split()[-1]) for line in probe.text.splitlines()
                       if line.startswith("kvflow:num_requests_running")]
            if running and running[0] >= args.num_streams or all(t.done() for t in stream_tasks):
                window.append(time.perf_counter())
        long_tasks = []
        for r in longs:
            long_tasks.append(asyncio.ensure_future(send_request(client, long_url + "/v1/completions",
                                                                 completion_payload(r, "bench"))))
            await asyncio.sleep(args.long_interval_s)
        long_records = await asyncio.gather(*long_tasks)
        window.append(time.perf_counter())
        stream_records = await asyncio.gather(*stream_tasks)
    errors = [r.error for r in stream_records + long_records if r.error]
    all_itl, in_window = [], []
    for rec in stream_records:
        times = rec.chunk_times
        for a, b in zip(times, times[1:]):
            all_itl.append(b - a)
            if window[0] <= b <= window[1]:
                in_window.append(b - a)
    ttft = [rec.chunk_times[0] - rec.start for rec in long_records if rec.chunk_times]
    return {"itl_during_long_ms": _percentiles(in_window), "itl_all_ms": _percentiles(all_itl),
            "long_ttft_ms": _percentiles(ttft), "errors": errors[:5], "num_errors": len(errors),
            "window_s": window[1] - window[0]}


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    import uvicorn

    from kvflow.entrypoints.router import Router, build_router_app

    cpus = args.cpus.split(",")
    serve = args.serve_args.split()
    if mode == "colocated":
        instances = [_start(serve, ",".join(cpus), len(cpus), None)]
    else:
        instances = [_start(serve, cpus[0], 1, "kv_producer"), _start(serve, cpus[-1], 1, "kv_consumer")]
    server = None
    try:
        wait_healthy(instances, args.startup_timeout)
        urls = [url for _, url in instances]
        if mode == "colocated":
            long_url = stream_url = urls[0]
        else:
            router = Router(urls[1:], "cache_aware", prefill_urls=urls[:1])
            port = free_port()
            server = uvicorn.Server(uvicorn.Config(build_router_app(router), host="127.0.0.1", port=port,
                                                   log_level="warning"))
            threading.Thread(target=server.run, daemon=True).start()
            while not server.started:
                time.sleep(0.05)
            while not router.prefills[0].kv_addr:  # learnt from the producer's GET /kv_transfer
                time.sleep(0.2)
            stream_url, long_url = urls[1], f"http://127.0.0.1:{port}"
        result = asyncio.run(_drive(args, stream_url, long_url))
        if mode != "colocated":
            kv = httpx.get(urls[1] + "/kv_transfer").json()["stats"]
            per = max(kv["requests"], 1)
            result["kv_transfer"] = {**kv, "bytes_per_request": kv["bytes"] / per,
                                     "ms_per_request": kv["seconds"] / per * 1e3,
                                     "load_ms_per_request": kv["load_seconds"] / per * 1e3,
                                     "chunks_per_request": kv["chunks"] / per}
            result["router"] = dict(router.disaggregated)
        return result
    finally:
        if server is not None:
            server.should_exit = True
        for proc, _ in instances:
            proc.terminate()
        for proc, _ in instances:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def run(args: argparse.Namespace) -> dict:
    results = {}
    print(f"{args.num_streams} decode streams x {args.stream_output_len} tokens; {args.num_long} prompts of "
          f"{args.long_len} tokens every {args.long_interval_s:g} s; cpus {args.cpus}")
    print("| mode | stream ITL p50 / p90 / p99 while long prompts run (ms) | ITL p99 whole run | long TTFT p50 / p99 "
          "| KV per long prompt | errors |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        r = results[mode] = run_mode(mode, args)
        w, a, t = r["itl_during_long_ms"], r["itl_all_ms"], r["long_ttft_ms"]
        kv = r.get("kv_transfer")
        kv_text = (f"{kv['bytes_per_request'] / 1e6:.1f} MB, {kv['ms_per_request']:.0f} ms wall "
                   f"({kv['load_ms_per_request']:.0f} ms writing, {kv['chunks_per_request']:.1f} chunks), "
                   f"{kv['failures']} failed" if kv else "-")
        print(f"| {mode} | {_fmt(w['p50'])} / {_fmt(w['p90'])} / {_fmt(w['p99'])} (n={w['n']}) | {_fmt(a['p99'])} "
              f"| {_fmt(t['p50'])} / {_fmt(t['p99'])} | {kv_text} | {r['num_errors']} |", flush=True)
    report = {"kind": "disagg", "results": results, "args": vars(args)}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return report
