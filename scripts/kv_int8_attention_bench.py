"""Decode attention over an int8 KV cache vs a bf16 one: one kernel call, timed.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64), block size 16,
a shuffled block table over a pool twice the cache, `--seqs` sequences of `--context` tokens
each, and one pool per layer (`--layers`, SmolLM2's 30): a timed pass calls every layer's
cache once, as a decode step does, so the caches are read from memory, not from L3. Prints
the median time per layer call of each cache and their ratio.
Run pinned to one core with OMP_NUM_THREADS=1 (docs/benchmarks.md, "int8 KV cache").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvflow.layers import cpu_kernels, kv_int8
from kvflow.layers.attention import AttentionMetadata, CPUAttentionBackend


def _metadata(seqs: int, context: int, block_size: int, num_blocks: int) -> AttentionMetadata:
    need = -(-context // block_size)
    ids = torch.randperm(num_blocks)[: seqs * need].view(seqs, need)
    last = context - 1
    return AttentionMetadata(slot_mapping=ids[:, last // block_size] * block_size + last % block_size,
                             query_start_loc=list(range(seqs + 1)), seq_lens=[context] * seqs,
                             block_tables=ids.contiguous(), num_decodes=seqs, block_size=block_size)


def _time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    kernels = cpu_kernels.load()
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    backend = CPUAttentionBackend()
    for context in args.context:
        num_blocks = 2 * args.seqs * -(-context // bs)
        meta = _metadata(args.seqs, context, bs, num_blocks)
        q = torch.randn(args.seqs, heads, dim).bfloat16()
        bf16 = backend.allocate_kv_caches(args.layers, num_blocks, bs, kv_heads, dim, torch.bfloat16)
        for c in bf16:
            c.normal_()
        int8 = backend.allocate_kv_caches(args.layers, num_blocks, bs, kv_heads, dim, torch.bfloat16, "int8")
        for c in int8:
            kv_int8.write(c, torch.randn(num_blocks * bs, kv_heads, dim), torch.randn(num_blocks * bs, kv_heads, dim),
                          torch.arange(num_blocks * bs), kernels)
        tables, lens = meta.block_tables, meta.seq_lens_tensor

        def run_bf16():
            for c in bf16:
                kernels.paged_decode_attention(q, c[0], c[1], tables, lens, dim**-0.5)

        def run_int8():
            for c in int8:
                kv_int8.paged_attention(kernels, q, c, meta, dim**-0.5)

        t_bf16 = _time(run_bf16, args.repeat) / args.layers
        t_int8 = _time(run_int8, args.repeat) / args.layers
        print(f"context {context:5d} x {args.seqs} seqs: bf16 {t_bf16 * 1e3:8.3f} ms  int8 {t_int8 * 1e3:8.3f} ms  "
              f"int8/bf16 time {t_int8 / t_bf16:.2f}x")


if __name__ == "__main__":
    main()
