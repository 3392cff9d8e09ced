"""Where a speculative step's milliseconds go, against a plain decode step, at batch 1.

Runs the same W-grounded requests (one at a time) through a plain engine and a speculating
one, alternating request by request, and times every phase of each step with perf_counter
wrappers around the engine's own methods (nothing in kvflow is changed for this):

  draft    the draft model's proposal: rollback + slots (`_catch_up`), input preparation,
           each forward (the first one of a step also catches up on the tokens the draft
           has not seen), its LM head and its sampling;
  schedule the scheduler;
  target   input preparation, the forward, the LM head, sampling or the rejection sampler;
  apply    bookkeeping after the step (append, stop checks, rollback of rejected K/V, frees).

Steps that carry a prefill (a prompt) are left out: the table is the steady decode state.
Speed-up = (plain ms per token) / (speculative ms per token), the same ratio as `kvflow
bench speculative` up to prefill time.

  taskset -c 1 python scripts/spec_step_profile.py --dtype bfloat16 --num-threads 1 --num-prompts 4 \
      --speculative-config '{"method":"draft_model","model":"<GGUF>","num_speculative_tokens":3,"quantization":"int4"}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import defaultdict

import torch

from kvflow.bench.grounded import grounded_requests
from kvflow.config import EngineConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.sampling.params import SamplingParams

PREFILL_TOKENS = 9  # a target forward with more tokens than a verify chunk (1 + k <= 8) carries a prompt


class StepTimer:
    """Accumulates labelled perf_counter durations into the current step's record."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.prefill = False

    def wrap(self, obj, name: str, label) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            key = label(args, result) if callable(label) else label
            self.current[key] += time.perf_counter() - start
            self.counts[key] += 1
            return result

        setattr(obj, name, timed)


def instrument(engine: LLMEngine, timer: StepTimer) -> None:
    runner = engine.runner

    def target_forward_label(args, _):
        n = args[0].numel()
        timer.prefill |= n >= PREFILL_TOKENS
        return f"target forward ({n} tok)" if n < PREFILL_TOKENS else "target forward (prefill)"

    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(runner, "prepare_inputs", "target inputs")
    timer.wrap(runner.model, "forward", target_forward_label)
    timer.wrap(runner.model, "compute_logits", lambda a, _: f"target LM head ({a[0].shape[0]} rows)")
    timer.wrap(runner, "sample", "target sampling")
    timer.wrap(runner, "sample_speculative", "target rejection sampler (incl. its sampling)")
    timer.wrap(runner, "execute", "target execute (total)")
    timer.wrap(engine, "_apply", "apply (bookkeeping)")
    if engine.speculator is not None:
        timer.wrap(engine.speculator, "propose", "propose (total)")
        draft = engine.speculator.draft
        if draft is not None:
            timer.wrap(draft, "_catch_up", "draft rollback + slots")
            timer.wrap(draft.runner, "prepare_inputs", "draft inputs")
            if hasattr(draft, "_decode_inputs"):  # a self-draft's one-token rows (shared KV)
                timer.wrap(draft, "_decode_inputs", "draft inputs")
            timer.wrap(draft.model, "forward", lambda a, _: f"draft forward ({min(a[0].numel(), PREFILL_TOKENS)}"
                       f"{'+' if a[0].numel() >= PREFILL_TOKENS else ''} tok)")
            timer.wrap(draft.model, "compute_logits", "draft LM head")
            timer.wrap(draft, "_sample", "draft sampling")


def run_requests(engine: LLMEngine, timer: StepTimer, requests, tag: str, steps: list) -> list[list[int]]:
    outputs = []
    for i, req in enumerate(requests):
        rid = f"{tag}-{i}"
        engine.add_request(rid, {"prompt_token_ids": req.prompt_token_ids},
                           SamplingParams(temperature=0, max_tokens=req.output_len))
        while engine.has_unfinished_requests():
            timer.current, timer.prefill = defaultdict(float), False
            before = engine.speculator.stats.num_accepted_tokens if engine.speculator else 0
            start = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    outputs.append(out.outputs[0].token_ids)
            wall = time.perf_counter() - start
            accepted = (engine.speculator.stats.num_accepted_tokens - before) if engine.speculator else 0
            steps.append((timer.prefill, wall, 1 + accepted, dict(timer.current)))
    return outputs


def summarize(steps: list) -> tuple[dict[str, float], int, float, int]:
    decode = [s for s in steps if not s[0]]
    n = len(decode)
    phases: dict[str, float] = defaultdict(float)
    for _, wall, _, cur in decode:
        phases["step (total)"] += wall
        for k, v in cur.items():
            phases[k] += v
    tokens = sum(s[2] for s in decode)
    return {k: v / max(n, 1) * 1e3 for k, v in phases.items()}, n, tokens, tokens / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--speculative-config", required=True)
    ap.add_argument("--json", help="write the two tables here")
    args = ap.parse_args()
    config = EngineConfig(dtype=args.dtype, num_threads=args.num_threads,
                          speculative_config=json.loads(args.speculative_config))
    spec = LLMEngine(config)
    plain = LLMEngine(dataclasses.replace(config, speculative_config=None))
    requests = grounded_requests(spec.tokenizer, args.num_prompts, 0, args.output_len)
    warm = grounded_requests(spec.tokenizer, 1, 100, args.output_len, requests)
    timers = {"plain": StepTimer(), "spec": StepTimer()}
    instrument(plain, timers["plain"])
    instrument(spec, timers["spec"])
    steps: dict[str, list] = {"plain": [], "spec": []}
    for name, engine in (("plain", plain), ("spec", spec)):
        run_requests(engine, timers[name], warm, f"warm-{name}", [])
    outs: dict[str, list] = {"plain": [], "spec": []}
    for i, req in enumerate(requests):  # alternate engines request by request
        order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
        for name in order:
            engine = plain if name == "plain" else spec
            outs[name] += run_requests(engine, timers[name], [req], f"{name}-{i}", steps[name])
    table = {name: summarize(steps[name]) for name in steps}
    keys = sorted(set(table["plain"][0]) | set(table["spec"][0]), key=lambda k: (k != "step (total)", k))
    print(f"torch threads {torch.get_num_threads()}, {args.dtype}, batch 1, {len(requests)} W-grounded prompts; "
          f"decode steps only (ms per step, mean)")
    print(f"{'phase':50s} {'plain':>9s} {'spec':>9s} {'calls/step':>11s}")
    for k in keys:
        calls = timers["spec"].counts.get(k, 0) / max(timers["spec"].counts.get("schedule", 1), 1)
        print(f"{k:50s} {table['plain'][0].get(k, 0.0):9.2f} {table['spec'][0].get(k, 0.0):9.2f} {calls:11.2f}")
    for name in ("plain", "spec"):
        per_step, n, tokens, per = table[name]
        prefill = [s for s in steps[name] if s[0]]
        print(f"{name}: {n} decode steps, {tokens} tokens, {per:.2f} tokens/step, "
              f"{per_step['step (total)'] / per:.2f} ms/token; {len(prefill)} prefill steps, "
              f"{sum(s[1] for s in prefill):.2f} s; all steps {sum(s[1] for s in steps[name]):.2f} s")
    ratio = (table["plain"][0]["step (total)"] / table["plain"][3]) / (table["spec"][0]["step (total)"] / table["spec"][3])
    print(f"decode-only speed-up x{ratio:.2f}; greedy outputs identical: {outs['plain'] == outs['spec']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: {"ms_per_step": t[0], "steps": t[1], "tokens": t[2]} for name, t in table.items()}, f,
                      indent=2)


if __name__ == "__main__":
    main()
