"""`kvflow bench speculative`: the same requests with and without speculative decoding, in one run.

Two engines on one model in one process: a plain one (the same options without
`--speculative-config`) and the speculating one. With `--max-concurrency 1` (batch 1, the
default) requests run one at a time and the engines alternate request by request, so that
machine noise and drift fall on both alike; with `--max-concurrency 0` each engine gets the
whole set at once (W-offline's shape). Each engine warms up on its own draw and meets every
timed prompt exactly once (each has its own prefix cache), so nothing is timed warm.

Reported: output tokens/s of each engine, their ratio, what speculation did (draft tokens,
acceptance rate, tokens per speculative step, acceptance by draft position), and for greedy
runs whether both engines produced identical tokens (they must).

Workloads: `grounded` (chat prompts over kvflow's own source whose answers quote the
prompt; `kvflow.bench.grounded`), `chat` (short open questions whose answers quote nothing;
`kvflow.bench.chat`), `random` (W-offline's random token ids and lengths), or `jsonl` (your own
prompts).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
from dataclasses import asdict, dataclass

from kvflow.bench.args import at_least
from kvflow.bench.machine import machine_info
from kvflow.bench.datasets import (WORKLOAD_TOKEN_RANGE, BenchRequest, fit_token_range, grounded_requests, jsonl_requests,
                                   random_like, random_requests)
from kvflow.bench.grounded import workload_fingerprint


@dataclass
class EngineRun:
    wall_s: float
    output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class SpecBenchResult:
    dataset: str
    num_requests: int
    max_concurrency: int
    temperature: float
    plain: EngineRun
    speculative: EngineRun
    num_draft_tokens: int
    num_accepted_tokens: int
    num_spec_steps: int
    accepted_per_position: list[int]
    identical_outputs: bool | None  # greedy only: None when sampling
    workload_fingerprint: str = ""  # sha256 of the timed prompts: the grounded set moves with kvflow's sources

    @property
    def speedup(self) -> float:
        return self.speculative.output_tokens_per_s / max(self.plain.output_tokens_per_s, 1e-9)

    def summary(self, spec_config: str) -> str:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        per_step = 1 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0
        batch = "one request at a time" if self.max_concurrency == 1 else (
            "all at once" if self.max_concurrency == 0 else f"{self.max_concurrency} at a time")
        lines = [
            f"speculative bench: {self.num_requests} {self.dataset} requests, {batch}, temperature {self.temperature}",
            f"  {spec_config}",
            f"  plain        {self.plain.output_tokens:6d} output tokens in {self.plain.wall_s:7.2f} s  "
            f"{self.plain.output_tokens_per_s:7.1f} tok/s",
            f"  speculative  {self.speculative.output_tokens:6d} output tokens in {self.speculative.wall_s:7.2f} s  "
            f"{self.speculative.output_tokens_per_s:7.1f} tok/s",
            f"  speed-up x{self.speedup:.2f} (output tokens/s, same run)",
            f"  drafts: {self.num_accepted_tokens}/{self.num_draft_tokens} accepted ({rate:.1%}), "
            f"{per_step:.2f} tokens per speculative step over {self.num_spec_steps} steps; "
            f"accepted by position {self.accepted_per_position}",
        ]
        lines.append(f"  workload fingerprint {self.workload_fingerprint[:16]}")
        if self.identical_outputs is not None:
            lines.append(f"  greedy outputs identical: {'yes' if self.identical_outputs else 'NO (a bug)'}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["speedup"] = self.speedup
        d["plain"]["output_tokens_per_s"] = self.plain.output_tokens_per_s
        d["speculative"]["output_tokens_per_s"] = self.speculative.output_tokens_per_s
        return d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", choices=["grounded", "chat", "random", "jsonl"], default="grounded")
    g.add_argument("--dataset-path", help="for --dataset jsonl")
    g.add_argument("--num-prompts", type=int, default=12)
    g.add_argument("--output-len", type=int, default=None,
                   help="max tokens per request (default: 128; random: W-offline's 32..256 per request)")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")
    g.add_argument("--max-concurrency", type=int, default=1, help="requests in flight: 1 (default) is batch 1, alternating engines; 0 submits all at once")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; else seeded sampling per request")
    g.add_argument("--dataset-seed", type=int, default=0)
    g.add_argument("--warmup-seed", type=int, default=100, help="another draw for the warm-up")
    g.add_argument("--num-warmup", type=int, default=2, help="warm-up requests per engine")
    g.add_argument("--output", help="write the result as JSON here")


def build_requests(args: argparse.Namespace, tokenizer, vocab_size: int, seed: int, count: int,
                   exclude: list[BenchRequest] | tuple = ()) -> list[BenchRequest]:
    if args.dataset == "grounded":
        return grounded_requests(tokenizer, count, seed, args.output_len or 128, exclude)
    if args.dataset == "chat":
        from kvflow.bench.chat import chat_requests

        return chat_requests(tokenizer, count, seed, args.output_len or 128, exclude)
    if args.dataset == "random":  # W-offline's definition (with --num-prompts 32 and --dataset-seed 0)
        token_range = fit_token_range(WORKLOAD_TOKEN_RANGE, vocab_size)
        out = (args.output_len, args.output_len) if args.output_len else (32, 256)
        return random_requests(count, (32, 512), out, seed, token_range)
    if not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")
    return jsonl_requests(args.dataset_path, tokenizer, args.output_len or 128)[:count]


def warmup_requests(args: argparse.Namespace, tokenizer, vocab_size: int, timed: list[BenchRequest]
                    ) -> list[BenchRequest]:
    """`--num-warmup` requests that share no prompt with the timed set, whose prefixes the warm-up
    would otherwise leave cached for the timed run to hit. A JSONL file has no second draw: its
    warm-up is random ids shaped like its first requests."""
    if args.dataset == "jsonl":
        return random_like(timed[: args.num_warmup], args.warmup_seed, fit_token_range(WORKLOAD_TOKEN_RANGE, vocab_size))
    return build_requests(args, tokenizer, vocab_size, args.warmup_seed, args.num_warmup, exclude=timed)


def _params(args: argparse.Namespace, req: BenchRequest, index: int):
    from kvflow.sampling.params import SamplingParams

    seed = None if args.temperature == 0 else 1000 * args.dataset_seed + index
    return SamplingParams(temperature=args.temperature, seed=seed, max_tokens=req.output_len,
                          ignore_eos=args.ignore_eos)


def _run(engine, requests: list[BenchRequest], args: argparse.Namespace, tag: str) -> tuple[float, list[list[int]]]:
    """Submit all requests at once and step to the end: (wall seconds, each request's tokens)."""
    start = time.perf_counter()
    ids = []
    for i, req in enumerate(requests):
        ids.append(f"{tag}-{i}")
        engine.add_request(ids[-1], {"prompt_token_ids": req.prompt_token_ids}, _params(args, req, i))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return time.perf_counter() - start, [tokens[i] for i in ids]


def check_arguments(args: argparse.Namespace) -> None:
    at_least(args, 1, "num_prompts", "output_len")
    at_least(args, 0, "max_concurrency", "num_warmup")
    if args.dataset == "jsonl" and not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")


def run(config, args: argparse.Namespace) -> SpecBenchResult:
    from kvflow.engine.llm_engine import LLMEngine

    if config.speculative_config is None:
        raise ValueError("bench speculative needs --speculative-config (the plain engine is the same without it)")
    check_arguments(args)
    spec = LLMEngine(config)
    plain = LLMEngine(dataclasses.replace(config, speculative_config=None))
    vocab = spec.model_config.vocab_size
    requests = build_requests(args, spec.tokenizer, vocab, args.dataset_seed, args.num_prompts)
    if args.num_warmup > 0:
        warmup = warmup_requests(args, spec.tokenizer, vocab, requests)
        for engine, tag in ((plain, "warm-plain"), (spec, "warm-spec")):
            _run(engine, warmup, args, tag)
    stats0 = copy.deepcopy(spec.get_stats().spec_decode)

    size = len(requests) if args.max_concurrency == 0 else args.max_concurrency
    batches = [requests[i : i + size] for i in range(0, len(requests), size)]
    walls = {"plain": 0.0, "spec": 0.0}
    outputs: dict[str, list[list[int]]] = {"plain": [], "spec": []}
    for b, batch in enumerate(batches):  # alternate engines batch by batch: drift falls on both
        order = (("plain", plain), ("spec", spec)) if b % 2 == 0 else (("spec", spec), ("plain", plain))
        for name, engine in order:
            wall, tokens = _run(engine, batch, args, f"{name}-{b}")
            walls[name] += wall
            outputs[name] += tokens
    stats = spec.get_stats().spec_decode.since(stats0)
    result = SpecBenchResult(
        dataset=args.dataset, num_requests=len(requests), max_concurrency=args.max_concurrency,
        temperature=args.temperature,
        plain=EngineRun(walls["plain"], sum(map(len, outputs["plain"]))),
        speculative=EngineRun(walls["spec"], sum(map(len, outputs["spec"]))),
        num_draft_tokens=stats.num_draft_tokens, num_accepted_tokens=stats.num_accepted_tokens,
        num_spec_steps=stats.num_spec_steps, accepted_per_position=stats.accepted_per_position,
        identical_outputs=outputs["plain"] == outputs["spec"] if args.temperature == 0 else None,
        workload_fingerprint=workload_fingerprint(requests),
    )
    print(result.summary(config.speculative_config.describe()))
    print("  machine: " + machine_info().describe())
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"kind": "speculative", "result": result.to_dict(), "args": vars(args),
                       "speculative_config": asdict(config.speculative_config),
                       "machine": asdict(machine_info())}, f, indent=2, default=str)
    return result
