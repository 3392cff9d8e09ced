"""What the peer-engine scripts share: the workload draws, the seeds, the command line and the
JSON figures. Each peer runs in a venv of its own (never a kvflow dependency), so this imports
nothing from kvflow and nothing beyond numpy and the standard library.

The draws are the ones `scripts/vllm_baseline/bench_vllm.py` already uses (imported from
there, not copied); they reproduce W-offline and W-latency exactly as
/work/shared/workloads/README.md defines them.

Honesty rules, the same for every peer: the warm-up uses a draw no timed run sees
(`default_rng(100)`, for both workloads), every timed W-offline run is a fresh draw (seeds 0,
1000, 2000; seed 0 is the canonical one), every timed W-latency call has its own prompt (seeds
1, 1001, 2001; seed 1 is the canonical one).
"""
import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm_baseline"))
from bench_vllm import N_REQ, latency_prompt, offline_draw  # noqa: E402  (numpy-only helpers)

WARMUP_SEED = 100
OFFLINE_SEEDS = (0, 1000, 2000)
LATENCY_SEEDS = (1, 1001, 2001)
LATENCY_PROMPT_LEN = 128
LATENCY_OUTPUT_LEN = 128
SMOKE_REQUESTS = 2
SMOKE_TOKENS = 8


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload", choices=["offline", "latency", "both"], default="both",
                    help="run the two in separate processes for honest per-workload peak RSS (run.sh does)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed fresh draws: W-offline seeds 0, 1000, 2000, ...; W-latency seeds 1, 1001, ...")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads (the workloads: all cores)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"{SMOKE_REQUESTS} requests / {SMOKE_TOKENS} output tokens, one draw: a pipeline "
                         "check, never a benchmark")
    return ap


def offline_seeds(args) -> list[int]:
    return [1000 * r for r in range(1 if args.smoke else args.repeat)]


def latency_seeds(args) -> list[int]:
    return [1 + 1000 * r for r in range(1 if args.smoke else args.repeat)]


def offline_requests(seed: int, smoke: bool) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) of one W-offline draw; --smoke keeps the first requests, capped."""
    prompts, out_lens = offline_draw(seed, SMOKE_REQUESTS if smoke else N_REQ)
    if smoke:
        out_lens = [min(n, SMOKE_TOKENS) for n in out_lens]
    return prompts, out_lens


def latency_request(seed: int, smoke: bool) -> tuple[list[int], int]:
    return latency_prompt(seed), SMOKE_TOKENS if smoke else LATENCY_OUTPUT_LEN


def peak_rss_gb() -> float:
    """This process's peak RSS (VmHWM); both peers run in-process, so this is the engine's."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3)


def machine() -> dict:
    family = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu family"):
                    family = int(line.split(":")[1])
                    break
    except OSError:
        pass
    return {"cpu_family": family, "cpus": os.cpu_count(), "python": platform.python_version(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def offline_figure(engine: dict, seed: int, prompts, out_lens, generated: int, wall: float, smoke: bool) -> dict:
    expected = sum(out_lens)
    if generated != expected:
        raise SystemExit(f"W-offline seed {seed}: generated {generated} tokens, expected {expected}")
    n_prompt = sum(len(p) for p in prompts)
    return {"workload": "W-offline" + ("-smoke" if smoke else ""), **engine, "seed": seed,
            "requests": len(prompts), "prompt_tokens": n_prompt, "output_tokens": generated,
            "wall_s": round(wall, 3), "total_tok_s": round((n_prompt + generated) / wall, 1),
            "output_tok_s": round(generated / wall, 1), "peak_rss_gb": peak_rss_gb()}


def latency_figure(engine: dict, seed: int, start: float, token_times: list[float], expected: int,
                   smoke: bool) -> dict:
    """TTFT: submission to the first token; ITL: the mean gap over the other tokens."""
    if len(token_times) != expected:
        raise SystemExit(f"W-latency seed {seed}: got {len(token_times)} tokens, expected {expected}")
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    return {"workload": "W-latency" + ("-smoke" if smoke else ""), **engine, "seed": seed,
            "prompt_tokens": LATENCY_PROMPT_LEN, "output_tokens": len(token_times),
            "ttft_ms": round((token_times[0] - start) * 1e3, 2),
            "mean_itl_ms": round(statistics.fmean(gaps) * 1e3, 3),
            "p50_itl_ms": round(statistics.median(gaps) * 1e3, 3), "max_itl_ms": round(max(gaps) * 1e3, 3),
            "total_s": round(token_times[-1] - start, 3), "peak_rss_gb": peak_rss_gb()}


def emit(figure: dict) -> None:
    print(json.dumps(figure), flush=True)


def emit_median(figures: list[dict], keys: tuple[str, ...]) -> None:
    """One more line with the medians over the timed draws, for the table in docs/benchmarks.md."""
    if len(figures) < 2:
        return
    per_draw = ("seed", "requests", "prompt_tokens", "output_tokens", "total_s", "p50_itl_ms", "max_itl_ms")
    row = {k: v for k, v in figures[0].items() if k not in keys and k not in per_draw}
    row.update({"seed": "median", "seeds": [f["seed"] for f in figures]})
    row.update({k: statistics.median(f[k] for f in figures) for k in keys})
    emit(row)


def time_offline(generate, args, ident: dict, extra=None) -> list[dict]:
    """W-offline for one peer: `generate(prompts, out_lens)` (-> each sequence's tokens) once on the
    warm-up draw, then timed on each fresh draw; one JSON line per draw (plus `extra(figure,
    generated)`'s fields), then the medians."""
    prompts, out_lens = offline_requests(WARMUP_SEED, args.smoke)
    t = time.perf_counter()
    generate(prompts, out_lens)
    print(f"[offline] warm-up (seed {WARMUP_SEED}) took {time.perf_counter() - t:.2f} s", flush=True)
    figures = []
    for seed in offline_seeds(args):
        prompts, out_lens = offline_requests(seed, args.smoke)
        t0 = time.perf_counter()
        generated = generate(prompts, out_lens)
        wall = time.perf_counter() - t0
        fig = offline_figure(ident, seed, prompts, out_lens, sum(map(len, generated)), wall, args.smoke)
        if extra is not None:
            extra(fig, generated)
        if args.smoke:
            fig["first_tokens"] = [g[:8] for g in generated]
        emit(fig)
        figures.append(fig)
    emit_median(figures, ("wall_s", "total_tok_s", "output_tok_s", "peak_rss_gb"))
    return figures


def time_latency(stream, args, ident: dict) -> list[dict]:
    """W-latency for one peer: `stream(prompt, n_out)` (-> start time, each token's time, the tokens)
    once on the warm-up prompt, then on each fresh prompt; one JSON line per call, then the medians."""
    prompt, n_out = latency_request(WARMUP_SEED, args.smoke)
    t = time.perf_counter()
    stream(prompt, n_out)
    print(f"[latency] warm-up (seed {WARMUP_SEED}) took {time.perf_counter() - t:.2f} s", flush=True)
    figures = []
    for seed in latency_seeds(args):
        prompt, n_out = latency_request(seed, args.smoke)
        start, times, tokens = stream(prompt, n_out)
        fig = latency_figure(ident, seed, start, times, n_out, args.smoke)
        if args.smoke:
            fig["tokens"] = tokens
        emit(fig)
        figures.append(fig)
    emit_median(figures, ("ttft_ms", "mean_itl_ms", "peak_rss_gb"))
    return figures
