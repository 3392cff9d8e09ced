"""Times kvflow's CPU kernels alone, outside the engine: the figures behind docs/benchmarks.md's
kernel tables (end-to-end claims come from `kvflow bench`; these say which kernel moved).

    python scripts/kernel_microbench.py gemm [ROWS ...]   # bf16 GEMM, quantized tiles, row-layout kernel
    python scripts/kernel_microbench.py layers [ROWS ...] # the model's 120 linears streamed from memory
    python scripts/kernel_microbench.py attention          # paged prefill and decode attention

Medians of 5 timed repeats after a warm-up, in microseconds (gemm) or milliseconds (attention);
run with OMP_NUM_THREADS set as the engine would be, and alternate commits in one sitting.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch

from kvflow.layers import cpu_kernels
from kvflow.quantization import kernels as row_layout
from kvflow.quantization import methods, tiles


def median_seconds(fn: Callable[[], object], reps: int = 1, repeats: int = 5) -> float:
    """Median over `repeats` timings of `reps` calls each, per call."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps)
    return sorted(times)[len(times) // 2]


def gemm(rows: list[int]) -> None:
    """SmolLM2-135M's gate/up and down shapes and its LM head's: bf16 against int8 (per channel)
    and int4 (groups of 32), each as tiles and in the row layout."""
    kernels = cpu_kernels.load()
    if kernels is None or not tiles.available():
        sys.exit("needs kvflow's CPU kernels with the quantized tiles (AVX512-BF16 or AVX2 + FMA)")
    for m in rows:
        for n, k in ((1536, 576), (576, 1536), (49152, 576)):
            w = torch.randn(n, k) * 0.05
            x = torch.randn(m, k).to(torch.bfloat16)
            reps = max(3, int(2000 / (m * n * k / 1e6 + 1)))
            packed = kernels.pack_weight(w.to(torch.bfloat16))
            cells = [f"m={m:4d} {n}x{k}",
                     f"bf16 {median_seconds(lambda: kernels.gemm(x, packed, n, None), reps) * 1e6:9.1f}"]
            for name, qw in (("int8", methods.quantize_int8(w)), ("int4", methods.quantize_int4(w, 32))):
                op = tiles.prepare(tiles.pack(qw))
                cells.append(f"{name}-tiles {median_seconds(lambda: op(x), reps) * 1e6:9.1f}")
                rl = row_layout.prepare(qw)
                cells.append(f"{name}-rows {median_seconds(lambda: rl(x), reps) * 1e6:9.1f}")
            print("  ".join(cells), flush=True)


def layers(rows: list[int]) -> None:
    """SmolLM2-135M's 120 linear layers (QKV, O, gate/up, down of 30 layers; 212 MB in bf16), each
    its own weight, called in turn as a decode or prefill step would: unlike `gemm`, whose one
    weight stays in L2, the weights come from memory. Milliseconds for all 120 calls, bf16
    against int8 (per channel) and int4 (groups of 32) tiles; KVFLOW_AMX=off for the vector units."""
    kernels = cpu_kernels.load()
    if kernels is None or not tiles.available():
        sys.exit("needs kvflow's CPU kernels with the quantized tiles (AVX512-BF16 or AVX2 + FMA)")
    torch.manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    ops: dict[str, list] = {"bf16": [], "int8": [], "int4": []}
    for n, k in shapes:
        w = torch.randn(n, k) * 0.05
        packed = kernels.pack_weight(w.to(torch.bfloat16))
        ops["bf16"].append((lambda x, p=packed, n=n: kernels.gemm(x, p, n, None), k))
        ops["int8"].append((tiles.prepare(tiles.pack(methods.quantize_int8(w))), k))
        ops["int4"].append((tiles.prepare(tiles.pack(methods.quantize_int4(w, 32))), k))
    for m in rows:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (576, 1536)}
        cells = [f"m={m:4d}"]
        for name, calls in ops.items():
            step = lambda calls=calls: [op(xs[k]) for op, k in calls]  # noqa: E731
            cells.append(f"{name} {median_seconds(step, repeats=7) * 1e3:7.2f} ms")
        print("  ".join(cells), flush=True)


def attention() -> None:
    """SmolLM2's heads (9 query, 3 KV, head_dim 64), blocks of 16: prefill of two 512-token
    prompts, and one decode step of 32 sequences at 400 keys (W-offline-like)."""
    kernels = cpu_kernels.load()
    if kernels is None:
        sys.exit("needs kvflow's CPU kernels")
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        prompt = 512
        blocks = 2 * prompt // block_size
        k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
        v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
        table = torch.arange(blocks, dtype=torch.int64).view(2, -1).contiguous()
        q = torch.randn(2 * prompt, heads, head_dim, generator=g).to(dtype)
        out = torch.empty_like(q)
        starts = torch.tensor([0, prompt, 2 * prompt], dtype=torch.int64)
        lens = torch.tensor([prompt, prompt], dtype=torch.int64)
        prefill = median_seconds(lambda: kernels.paged_prefill_attention(q, k_cache, v_cache, table, starts, lens,
                                                                         out, 0.125))
        seqs, keys = 32, 400
        per_seq = -(-keys // block_size)
        dk = torch.randn(seqs * per_seq, block_size, kv_heads, head_dim, generator=g).to(dtype)
        dv = torch.randn(seqs * per_seq, block_size, kv_heads, head_dim, generator=g).to(dtype)
        dtable = torch.arange(seqs * per_seq, dtype=torch.int64).view(seqs, per_seq).contiguous()
        dq = torch.randn(seqs, heads, head_dim, generator=g).to(dtype)
        dlens = torch.full((seqs,), keys, dtype=torch.int64)
        decode = median_seconds(lambda: kernels.paged_decode_attention(dq, dk, dv, dtable, dlens, 0.125), repeats=9)
        print(f"{dtype}: prefill 2 x {prompt} {prefill * 1e3:.2f} ms   decode {seqs} x {keys} {decode * 1e3:.3f} ms")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("gemm", "layers", "attention"):
        sys.exit(__doc__)
    if sys.argv[1] == "gemm":
        gemm([int(a) for a in sys.argv[2:]] or [1, 4, 16, 64, 256])
    elif sys.argv[1] == "layers":
        layers([int(a) for a in sys.argv[2:]] or [1, 4, 16, 32, 64, 512])
    else:
        attention()
