"""Time one sparse MoE block (layers/moe.py) at decode- and prefill-sized steps: its C++ kernel
(csrc/moe.cpp) and its PyTorch path, alternated, against the GEMM floor of the same expert work:
what the routing and per-expert dispatch cost.

    .venv/bin/python scripts/moe_block_cost.py [--dtype bfloat16] [--experts 32 --top-k 4]

Weights are random (routing is then near-uniform, as in a trained model's balanced layers).
The floor runs each chosen expert's GEMMs on as many rows as the block gives it, without the
gather, weighting and scatter, so block/floor is the dispatch overhead."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvflow.layers.linear import pack_linear_weights
from kvflow.layers.moe import SparseMoeBlock


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", default="1,16,64,512,2048")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    block = SparseMoeBlock(args.hidden, args.experts, args.top_k, args.intermediate, norm_topk_prob=True,
                           round_weights=True).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    pack_linear_weights(block)
    if block.kernel_record() is None:
        raise SystemExit("csrc/moe.cpp does not run here (no kernels for this dtype, or KVFLOW_MOE_KERNEL=0)")
    print(f"E={args.experts} top-{args.top_k} hidden={args.hidden} expert={args.intermediate} {args.dtype}")
    with torch.inference_mode():
        for n in map(int, args.tokens.split(",")):
            x = torch.randn(n, args.hidden).to(dtype)
            counts = torch.bincount(block.route(x)[1].flatten(), minlength=args.experts).tolist()
            inputs = [torch.randn(c, args.hidden).to(dtype) for c in counts if c]
            chosen = [e for e, c in zip(block.experts, counts) if c]
            runs = {"floor": lambda: [e(r) for e, r in zip(chosen, inputs)], "kernel": lambda: block(x),
                    "torch": lambda: block.forward_torch(x)}
            samples: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.repeats):  # alternated, so a noisy neighbour hits all three alike
                for name, fn in runs.items():
                    samples[name].append(timed(fn, 1))
            ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
            print(f"  {n:5d} tokens, {len(chosen):3d} experts hit: kernel {ms['kernel']:7.2f} ms, "
                  f"torch {ms['torch']:7.2f} ms, the expert modules alone {ms['floor']:7.2f} ms; "
                  f"kernel/floor {ms['kernel'] / ms['floor']:4.2f}x, torch/kernel {ms['torch'] / ms['kernel']:4.2f}x")


if __name__ == "__main__":
    main()
