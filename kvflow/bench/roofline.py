"""`kvflow bench roofline`: how close a measured speed is to what this machine allows.

The model's cost comes from its shapes alone (no weights are loaded): the matmul FLOPs of a
prompt token (2 x the non-embedding matmul parameters; no LM head, which only the last prompt
token needs), of a generated token (+ the LM head), and the weight bytes one decode step
must stream. Against the ceilings measured by `hardware`:

  prefill   FLOP rate / matmul ceiling (prefill is compute-bound)
  decode    tokens/s against the roofline min(bandwidth / bytes per step, compute / FLOPs),
            i.e. against whichever ceiling binds at that batch size
  a whole throughput run   (prompt x prompt FLOPs + output x output FLOPs) / wall / ceiling

Attention FLOPs and KV cache reads are left out of these (small at these context lengths), so
the fractions are slight overestimates of the work done, i.e. conservative about the ceiling.

A throughput result that carries its steps' shapes (engine/step_shape.py) also gets the run's
floor: each step at least max(its FLOPs, attention's included, at the matmul ceiling; its bytes,
every weight once plus the K/V its attention reads, at the memory bandwidth), summed over the
steps. That says how much of the compute ceiling the run's own schedule could reach at best
(a tail of small decode steps is memory-bound however fast the kernels), and how close to
that floor the run came.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from kvflow.config import ModelConfig


@dataclass
class ModelCost:
    dtype: str
    non_embedding_matmul_params: int
    lm_head_params: int
    flops_per_prompt_token: float
    flops_per_output_token: float
    weight_bytes_per_decode_step: int
    attention_flops_per_pair: float = 0.0  # q.k and p.v of one (query, key) pair, all layers
    kv_bytes_per_token: float = 0.0  # one cached token's K and V, all layers


@dataclass
class RunFloor:
    """A run's attainable time from its steps' shapes (the module docstring)."""

    floor_s: float
    steps: int
    memory_bound_steps: int
    memory_bound_s: float  # of floor_s, in steps that bandwidth binds
    best_compute_fraction: float  # the matmul FLOPs over floor_s, against the ceiling


@dataclass
class Fraction:
    """One measured speed against its ceiling."""

    phase: str
    tokens_per_s: float
    achieved_gflops: float
    compute_fraction: float  # of the matmul ceiling
    achieved_gbps: float | None = None  # weight bytes streamed per second (decode)
    bandwidth_fraction: float | None = None
    roofline_tokens_per_s: float | None = None  # the attainable speed
    roofline_fraction: float | None = None
    bound: str = "compute"
    floor: RunFloor | None = None  # a whole run with its steps' shapes
    floor_fraction: float | None = None  # floor.floor_s / wall: how close the run came to its floor


def model_cost(cfg: ModelConfig, dtype: torch.dtype) -> ModelCost:
    """Matmul FLOPs and decode bytes from the shapes (a multiply-add is 2 FLOPs). A mixture of
    experts counts the weights one token reads (its top-k experts): its FLOPs exactly, its decode
    bytes at one sequence (a batch touches more experts, up to all of them)."""
    h = cfg.hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    body = cfg.num_linear_parameters(active=True)  # qkv, o, gate/up/down
    head = h * cfg.vocab_size
    elem = torch.tensor([], dtype=dtype).element_size()
    name = str(dtype).removeprefix("torch.")
    attention = 4.0 * cfg.num_hidden_layers * q  # 2 FLOPs for q.k and 2 for p.v per head dimension
    kv_bytes = 2.0 * cfg.num_hidden_layers * kv * elem
    return ModelCost(name, body, head, 2.0 * body, 2.0 * (body + head), (body + head) * elem, attention, kv_bytes)


def run_floor(cost: ModelCost, steps: list[list[int]], gflops_ceiling: float, read_gbps: float) -> RunFloor:
    """Sum over steps ([tokens, logits_rows, attention_pairs, kv_tokens_read]) of each one's roofline time."""
    floor = memory_s = 0.0
    memory_steps = 0
    matmul_flops = 0.0
    lm_head_flops = cost.flops_per_output_token - cost.flops_per_prompt_token  # per row through the LM head
    for tokens, logits_rows, pairs, kv_tokens in steps:
        matmul = tokens * cost.flops_per_prompt_token + logits_rows * lm_head_flops
        matmul_flops += matmul
        compute_s = (matmul + pairs * cost.attention_flops_per_pair) / (gflops_ceiling * 1e9)
        bytes_s = (cost.weight_bytes_per_decode_step + kv_tokens * cost.kv_bytes_per_token) / (read_gbps * 1e9)
        floor += max(compute_s, bytes_s)
        if bytes_s > compute_s:
            memory_steps += 1
            memory_s += bytes_s
    best = matmul_flops / floor / (gflops_ceiling * 1e9) if floor > 0 else 0.0
    return RunFloor(floor, len(steps), memory_steps, memory_s, best)


def prefill_fraction(cost: ModelCost, prompt_tokens_per_s: float, gflops_ceiling: float) -> Fraction:
    achieved = prompt_tokens_per_s * cost.flops_per_prompt_token / 1e9
    ceiling_tps = gflops_ceiling * 1e9 / cost.flops_per_prompt_token
    return Fraction("prefill", prompt_tokens_per_s, achieved, achieved / gflops_ceiling,
                    roofline_tokens_per_s=ceiling_tps, roofline_fraction=prompt_tokens_per_s / ceiling_tps)


def decode_fraction(cost: ModelCost, tokens_per_s: float, gflops_ceiling: float, read_gbps: float,
                    batch_size: int = 1) -> Fraction:
    """Each step makes `batch_size` tokens and streams every weight once."""
    steps_per_s = tokens_per_s / batch_size
    achieved_gflops = tokens_per_s * cost.flops_per_output_token / 1e9
    achieved_gbps = steps_per_s * cost.weight_bytes_per_decode_step / 1e9
    memory_step_s = cost.weight_bytes_per_decode_step / (read_gbps * 1e9)
    compute_step_s = batch_size * cost.flops_per_output_token / (gflops_ceiling * 1e9)
    roofline_tps = batch_size / max(memory_step_s, compute_step_s)
    return Fraction(f"decode (batch {batch_size})", tokens_per_s, achieved_gflops, achieved_gflops / gflops_ceiling,
                    achieved_gbps, achieved_gbps / read_gbps, roofline_tps, tokens_per_s / roofline_tps,
                    "memory" if memory_step_s >= compute_step_s else "compute")


def run_fraction(cost: ModelCost, prompt_tokens: int, output_tokens: int, wall_s: float,
                 gflops_ceiling: float, label: str = "kvflow", steps: list[list[int]] | None = None,
                 read_gbps: float | None = None) -> Fraction:
    """A whole mixed run (bench throughput): all its matmul work over its wall time; with its
    steps' shapes and the bandwidth, also its floor (run_floor)."""
    flops = prompt_tokens * cost.flops_per_prompt_token + output_tokens * cost.flops_per_output_token
    achieved = flops / wall_s / 1e9
    floor_s = flops / (gflops_ceiling * 1e9)
    total_tps = (prompt_tokens + output_tokens) / wall_s
    fraction = Fraction(f"whole run ({label})", total_tps, achieved, achieved / gflops_ceiling,
                        roofline_tokens_per_s=(prompt_tokens + output_tokens) / floor_s,
                        roofline_fraction=floor_s / wall_s)
    if steps and read_gbps:
        fraction.floor = run_floor(cost, steps, gflops_ceiling, read_gbps)
        fraction.floor_fraction = fraction.floor.floor_s / wall_s
    return fraction


def speeds_from_result(path: str) -> list[dict]:
    """The speeds a `bench throughput` (kvflow and any baseline) or `bench latency` JSON holds, with dtypes."""
    with open(path) as f:
        data = json.load(f)
    res = data.get("result") or {}
    kind = data.get("kind") or ("latency" if "ttft" in res else "throughput")
    if kind == "latency":
        ttft, itl = res["ttft"]["p50"], res["itl"]["p50"]
        return [{"kind": kind, "dtype": res.get("dtype"), "prefill_tokens_per_s": res["input_len"] / ttft,
                 "decode_tokens_per_s": 1.0 / itl if itl else None}]
    if kind == "throughput":
        runs = [r for r in (res, data.get("baseline")) if r]
        return [{"kind": kind, "dtype": r.get("dtype"), "label": r.get("engine", "kvflow"),
                 "prompt_tokens": r["prompt_tokens"], "output_tokens": r["output_tokens"], "wall_s": r["wall_s"],
                 "steps": r.get("steps") or []}
                for r in runs]
    raise ValueError(f"{path}: not a bench throughput or bench latency result (kind {kind!r})")


def _exceeded(f: Fraction) -> dict[str, float]:
    """The ceilings this speed is above: {name: achieved / ceiling}."""
    shares = {"compute": f.compute_fraction, "memory bandwidth": f.bandwidth_fraction, "roofline": f.roofline_fraction,
              "step floor": f.floor_fraction}
    return {name: x for name, x in shares.items() if x is not None and x > 1.0}


def ceiling_warnings(fractions: list[Fraction]) -> list[str]:
    """A run cannot beat a true ceiling: one it beats was measured while the machine was busy."""
    warnings = []
    for f in fractions:
        over = _exceeded(f)
        if over:
            worst = ", ".join(f"{name} {x:.2f}x" for name, x in over.items())
            warnings.append(
                f"warning: {f.phase} ran faster than the ceiling measured now ({worst} of it): the machine was "
                "busier while the ceilings were measured than during the run, so these ceilings are too low; "
                "rerun `kvflow bench roofline` on an idle machine (no shares above 100% are printed)"
            )
    return warnings


def _share(x: float) -> str:
    return f"{x:.1%}" if x <= 1.0 else "above the measured ceiling (see the warning)"


def describe(cost: ModelCost, ceilings, fractions: list[Fraction]) -> str:
    gf = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in ceilings.matmul_gflops.items())
    lines = [
        f"machine ({ceilings.num_threads} threads): matmul {gf} ({ceilings.matmul_size}^3, median of {ceilings.reps}); "
        f"memory read {ceilings.read_gbps:.1f} GB/s ({ceilings.bandwidth_mib} MiB)",
        f"model ({cost.dtype}): {cost.non_embedding_matmul_params / 1e6:.3g} M matmul params + LM head "
        f"{cost.lm_head_params / 1e6:.3g} M; {cost.flops_per_prompt_token / 1e9:.3g} GFLOP/prompt token, "
        f"{cost.flops_per_output_token / 1e9:.3g} GFLOP/generated token, "
        f"{cost.weight_bytes_per_decode_step / 1e6:.3g} MB of weights per decode step",
    ]
    for f in fractions:
        line = (f"{f.phase}: {f.tokens_per_s:.1f} tok/s = {f.achieved_gflops:.1f} GFLOP/s = "
                f"{_share(f.compute_fraction)} of the compute ceiling")
        if f.bandwidth_fraction is not None:
            line += f"; {f.achieved_gbps:.1f} GB/s of weights = {_share(f.bandwidth_fraction)} of memory bandwidth"
        if f.roofline_fraction is not None:
            line += (f"; roofline ({f.bound}-bound) {f.roofline_tokens_per_s:.0f} tok/s -> "
                     f"{_share(f.roofline_fraction)} of it")
        lines.append(line)
        if f.floor is not None and f.floor_fraction is not None:
            fl = f.floor
            lines.append(
                f"  step floor: {fl.floor_s:.2f} s over {fl.steps} steps ({fl.memory_bound_steps} memory-bound, "
                f"{fl.memory_bound_s:.2f} s of it): this schedule reaches at best {_share(fl.best_compute_fraction)} "
                f"of the compute ceiling; the run reached {_share(f.floor_fraction)} of the speed that floor allows")
    lines.extend(ceiling_warnings(fractions))
    if not fractions:
        lines.append("(give --result or --prefill-tokens-per-s / --decode-tokens-per-s for the achieved fractions)")
    return "\n".join(lines)


def compute_dtype(label: str) -> str:
    """The activations' dtype of a result's numerics label (results.numerics_label): its first
    part, "bfloat16" in "bfloat16, weights gguf (Q4_1, as shipped), KV int8"."""
    return label.split(",", 1)[0].strip()


def _unquantized_steps(speed: dict) -> list[list[int]]:
    """A result's steps for its floor, which counts weights and K/V in the compute dtype: none
    for quantized weights or KV (fewer bytes than it counts, so its floor would be too high)."""
    dtype = speed.get("dtype") or ""
    return [] if ("weights" in dtype or "KV" in dtype) else speed.get("steps") or []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("roofline")
    g.add_argument("--model", default=None, help="HF directory, config.json or .gguf (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=None, help="compute dtype (default: the result's, else auto)")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores, as the engine)")
    g.add_argument("--result", action="append", default=[],
                   help="a bench throughput or bench latency JSON (repeatable)")
    g.add_argument("--prefill-tokens-per-s", type=float, default=None)
    g.add_argument("--decode-tokens-per-s", type=float, default=None)
    g.add_argument("--decode-batch-size", type=int, default=1, help="sequences per decode step behind that rate")
    g.add_argument("--output", help="write ceilings, cost and fractions as JSON here")
    g.add_argument("--matmul-size", type=int, default=2048, help=argparse.SUPPRESS)
    g.add_argument("--bandwidth-mib", type=int, default=256, help=argparse.SUPPRESS)
    g.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> list[Fraction]:
    import os

    from kvflow.bench.hardware import measure
    from kvflow.config import resolve_dtype
    from kvflow.loader import load_model_config, resolve_model_path

    speeds = [s for p in args.result for s in speeds_from_result(p)]
    cfg = load_model_config(resolve_model_path(args.model))
    dtype = resolve_dtype(args.dtype or next((compute_dtype(s["dtype"]) for s in speeds if s.get("dtype")), "auto"), cfg)
    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    ceilings = measure([torch.float32, torch.bfloat16, dtype], args.matmul_size, args.bandwidth_mib, args.reps)
    cost = model_cost(cfg, dtype)
    peak = ceilings.gflops(dtype)
    fractions: list[Fraction] = []
    for s in speeds:
        if s["kind"] == "throughput":
            fractions.append(run_fraction(cost, s["prompt_tokens"], s["output_tokens"], s["wall_s"], peak, s["label"],
                                          _unquantized_steps(s), ceilings.read_gbps))
        else:
            fractions.append(prefill_fraction(cost, s["prefill_tokens_per_s"], peak))
            if s["decode_tokens_per_s"]:
                fractions.append(decode_fraction(cost, s["decode_tokens_per_s"], peak, ceilings.read_gbps, 1))
    if args.prefill_tokens_per_s:
        fractions.append(prefill_fraction(cost, args.prefill_tokens_per_s, peak))
    if args.decode_tokens_per_s:
        fractions.append(decode_fraction(cost, args.decode_tokens_per_s, peak, ceilings.read_gbps,
                                         args.decode_batch_size))
    print(describe(cost, ceilings, fractions))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"kind": "roofline", "ceilings": asdict(ceilings), "model_cost": asdict(cost),
                       "fractions": [asdict(x) for x in fractions], "results": args.result,
                       "warnings": ceiling_warnings(fractions)}, f, indent=2)
    return fractions
