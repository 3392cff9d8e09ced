"""Where W-offline's time goes: two runs of the timed draw, each on a fresh engine.

1. The fused stack (the default path): wall time and time in prefill-carrying vs decode steps.
2. The module path (KVFLOW_FUSED_STACK=0's): the same split, with every kvflow CPU-kernel call
   timed from Python, so each step splits into GEMM, attention, elementwise kernels, sampling
   and scheduling; what is left is Python glue, which the fused stack removes.

    .venv/bin/python scripts/w_offline_breakdown.py [bfloat16|float32]   (default bfloat16)

Timing wrappers add a little overhead of their own; use `kvflow bench throughput` for the
headline figure and this for the split. On each engine the first draw (seed 100) warms up;
seed 0 is W-offline.
"""
import collections
import functools
import sys
import time

from kvflow.bench.datasets import random_requests
from kvflow.config import EngineConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.layers import cpu_kernels
from kvflow.sampling.params import SamplingParams

DTYPE = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
K = cpu_kernels.load()
acc = collections.Counter()  # seconds per kernel, from the wrappers below
for name in ("paged_prefill_attention", "paged_decode_attention", "gemm_prevalidated", "add_rms_norm",
             "silu_and_mul", "rotary_", "write_kv"):
    def wrap(*a, _f=getattr(K, name), _n=name, **kw):
        t = time.perf_counter(); r = _f(*a, **kw); acc[_n] += time.perf_counter() - t; return r
    setattr(K, name, wrap)


def engine(fused: bool):
    eng = LLMEngine(EngineConfig(dtype=DTYPE))
    r = eng.runner
    tm = collections.Counter()

    def tw(obj, attr, n):
        f = getattr(obj, attr)
        def g(*a, **k):
            t = time.perf_counter(); x = f(*a, **k); tm[n] += time.perf_counter() - t; return x
        setattr(obj, attr, g)

    if not fused:
        r.model.fused_stack = None
        for lin in [m for m in r.model.modules() if hasattr(m, "_gemm")]:  # rebind to the timed GEMM
            lin._gemm = functools.partial(K.gemm_prevalidated, packed=lin.packed_weight, n=lin.out_features,
                                          bias=lin.packed_bias)
    tw(r, "sample", "sampling"); tw(r, "prepare_inputs", "prepare_inputs"); tw(eng.scheduler, "schedule", "schedule")
    tw(eng.scheduler, "update_after_step", "update_after_step"); tw(r.model, "compute_logits", "lm_head")
    return eng, tm


def run(eng, tm, seed):
    for i, req in enumerate(random_requests(seed=seed)):  # W-offline's draw
        eng.add_request(f"{seed}-{i}", {"prompt_token_ids": req.prompt_token_ids},
                        SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=True))
    kinds = collections.Counter(); comp = {"prefill": collections.Counter(), "decode": collections.Counter()}
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        a0, m0 = acc.copy(), tm.copy()
        prefill = any(len(r.seq.prompt_token_ids) > r.seq.num_computed_tokens for r in eng._requests.values())
        t = time.perf_counter(); eng.step(); dt = time.perf_counter() - t
        k = "prefill" if prefill else "decode"; kinds[k] += dt
        for n in acc: comp[k][n] += acc[n] - a0.get(n, 0)
        for n in tm: comp[k][n] += tm[n] - m0.get(n, 0)
    return time.perf_counter() - t0, kinds, comp


for fused in (True, False):
    eng, tm = engine(fused)
    run(eng, tm, 100)
    acc.clear(); tm.clear()
    wall, kinds, comp = run(eng, tm, 0)
    print(f"{'fused stack' if fused else 'module path, kernels timed'}: wall {wall:.2f} s, {13675/wall:.0f} tok/s")
    for k in ("prefill", "decode"):
        tot = kinds[k]
        print(f"  {k}-carrying steps: {tot:.2f} s")
        lm = comp[k].get("lm_head", 0)
        for n, v in sorted(comp[k].items(), key=lambda x: -x[1]):
            print(f"     {n:28s} {v:6.2f} s  {100*v/tot:5.1f}%")
        # lm_head's time is inside its GEMM's (module path), so it is added back once.
        rest = tot - sum(comp[k].values()) + (0 if fused else lm)
        print(f"     {'rest of the step' if fused else 'glue (rest of the step)':28s} {rest:6.2f} s")
    del eng
