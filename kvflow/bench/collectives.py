"""`kvflow bench collectives`: the cost of tensor- and pipeline-parallel communication alone.

Spawns `--ranks` processes joined over gloo (the CPU backend the engine's workers use) and
times, per message size, the median of `--iters` calls of:
  all_reduce   what each row-parallel projection does (o_proj, down_proj: two per layer),
               on [tokens, hidden] in the model's dtype, over gloo and over the shared-memory
               segment that tensor-parallel ranks on one host use (distributed/shm_all_reduce.py);
  send/recv    what a pipeline stage hands the next: [2, tokens, hidden] (hidden state and
               residual), timed as a round trip and halved.
Sizes: decode steps (1 to 256 tokens of one new token each) and prefill chunks (up to 2048),
at SmolLM2-135M's hidden size (576) by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvflow.config import resolve_dtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="processes in the group (default 2)")
    parser.add_argument("--hidden-size", type=int, default=576, help="hidden size (default SmolLM2-135M's 576)")
    parser.add_argument("--tokens", default="1,8,32,256,2048", help="rows per message, comma-separated")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", default=None, help="also write the rows to this file")


def _rank_main(rank: int, ranks: int, port: int, sizes: list[int], hidden: int, dtype: torch.dtype, iters: int,
               queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    from kvflow.distributed.parallel_state import open_shm_all_reduce
    from kvflow.distributed.shm_all_reduce import shm_all_reduce_supported

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    shm = open_shm_all_reduce(rank, list(range(ranks)), dist.group.WORLD, 60.0) if shm_all_reduce_supported() else None

    def timed(reduce, x: torch.Tensor) -> float:
        for _ in range(10):
            reduce(x)
        dist.barrier()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            reduce(x)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    rows = []
    for n in sizes:
        x = torch.randn(n, hidden).to(dtype)
        gloo_us = timed(dist.all_reduce, x)
        shm_us = timed(shm.all_reduce, x) if shm is not None and shm.fits(x) else None
        both = torch.randn(2, n, hidden).to(dtype)
        trips = []
        for _ in range(max(10, iters // 2)):
            start = time.perf_counter()
            if rank == 0:
                dist.send(both, 1)
                dist.recv(both, 1)
            elif rank == 1:
                dist.recv(both, 0)
                dist.send(both, 0)
            trips.append(time.perf_counter() - start)
        rows.append({"tokens": n, "bytes": x.numel() * x.element_size(),
                     "all_reduce_us": gloo_us, "shm_all_reduce_us": shm_us,
                     "send_recv_bytes": both.numel() * both.element_size(),
                     "send_recv_us": statistics.median(trips) * 1e6 / 2})
    if rank == 0:
        queue.put(rows)
    if shm is not None:
        shm.close()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> list[dict]:
    import multiprocessing as mp

    from kvflow.distributed.executor import free_port

    if args.ranks < 2:
        raise ValueError(f"--ranks must be at least 2, got {args.ranks}")
    sizes = [int(t) for t in str(args.tokens).split(",")]
    dtype = resolve_dtype(args.dtype)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args.ranks, port, sizes, args.hidden_size, dtype, args.iters,
                                                  queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join(30)
    print(f"{args.ranks} ranks, hidden {args.hidden_size}, {args.dtype}, median of {args.iters}; all-reduce over gloo "
          "and over shared memory (the engine's choice on one host; '-' where a message exceeds its slot)")
    print(f"{'tokens':>7} {'bytes':>11} {'gloo µs':>9} {'shm µs':>8} {'send_recv bytes':>16} {'send/recv µs':>13}")
    for r in rows:
        shm_us = "-" if r["shm_all_reduce_us"] is None else f"{r['shm_all_reduce_us']:.1f}"
        print(f"{r['tokens']:>7} {r['bytes']:>11,} {r['all_reduce_us']:>9.1f} {shm_us:>8} {r['send_recv_bytes']:>16,} "
              f"{r['send_recv_us']:>13.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
