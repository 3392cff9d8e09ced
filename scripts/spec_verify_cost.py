"""How much a step costs when each decoding sequence also verifies k draft tokens.

Prints, for batch sizes B, the median time of one step with B sequences x 1 token (plain
decode) and with B x (1 + k) tokens (every sequence verifying k drafts), and their ratio:
speculation pays only while the tokens it gains per step exceed that ratio. The numbers set
speculative_config's disable_by_batch_size default (docs/benchmarks.md).

  python scripts/spec_verify_cost.py --dtype float32 --k 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvflow.config import EngineConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.scheduler import ScheduledSequence, SchedulerOutput
from kvflow.sampling.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(dtype=args.dtype, max_num_batched_tokens=8192))
    rng = np.random.default_rng(0)
    for b in map(int, args.batches.split(",")):
        for i in range(b):
            engine.add_request(f"{b}-{i}", {"prompt_token_ids": rng.integers(1000, 40000, args.context).tolist()},
                               SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
        while any(s.num_tokens - s.num_computed_tokens > 1 or s.num_computed_tokens == 0
                  for s in engine.scheduler.running + engine.scheduler.waiting):
            engine.step()
        seqs = list(engine.scheduler.running)
        times = {}
        for k in (0, args.k):
            out = SchedulerOutput()
            for seq in seqs:
                drafts = rng.integers(1000, 40000, k).tolist()
                assert engine.kv_cache_manager.allocate_slots(seq, 1 + k)
                out.scheduled.append(ScheduledSequence(seq, 1 + k, drafts))
            samples = []
            for _ in range(args.reps):
                start = time.perf_counter()
                engine.runner.execute(out)
                samples.append(time.perf_counter() - start)
            times[k] = statistics.median(samples)
        print(f"B={b:3d}: decode {times[0] * 1e3:7.1f} ms, verify {args.k} drafts {times[args.k] * 1e3:7.1f} ms, "
              f"ratio {times[args.k] / times[0]:.2f}", flush=True)
        for seq in seqs:
            engine.abort_request(seq.request_id)


if __name__ == "__main__":
    main()
