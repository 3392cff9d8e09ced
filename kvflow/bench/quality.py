"""`kvflow bench quality`: what a quantization mode costs in accuracy, measured.

For each mode (the first is the baseline) the same text is scored through the engine's own
`prompt_logprobs`, the path evaluation harnesses such as lm-evaluation-harness use:
  - perplexity: exp of the mean negative log-probability of every token given the ones
    before it, over consecutive windows of `--window` tokens (each window's first token has
    no context and is not scored);
  - top-1 agreement: at how many positions the mode's most likely next token is the
    baseline's (teacher-forced greedy agreement).

The default text is Chapter I of Lewis Carroll's "Alice's Adventures in Wonderland" (1865;
public domain, Project Gutenberg eBook #11), shipped as kvflow/bench/data/alice_chapter1.txt:
about 3,000 SmolLM2 tokens. A mode is a quantization name with an optional group size, and
optionally `+kv-int8` for the int8 KV cache (`kv-int8` alone: unquantized weights), e.g.
`none,int8,int4,int4-g128,gguf,kv-int8,int4+kv-int8`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "alice_chapter1.txt"


@dataclass
class ModeQuality:
    mode: str
    weights: str  # the plan's description of the linear layers' format
    kv_cache_dtype: str  # the plan's KV dtype, e.g. "float32" or "int8"
    weight_bytes: int
    num_scored: int
    perplexity: float
    top1_agreement: float  # against the baseline (1.0 for the baseline itself)
    wall_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default="none,int8,int4",
                        help="comma-separated quantization modes, the first the baseline (e.g. none,int8,int4,"
                             "int4-g128,gguf,kv-int8,int4+kv-int8)")
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="a UTF-8 text file to score")
    parser.add_argument("--window", type=int, default=512, help="tokens per scored window")
    parser.add_argument("--json", default=None, help="also write the results here")


def parse_mode(mode: str) -> tuple[str, int | None, str]:
    """'int4-g128' -> ('int4', 128, 'auto'); 'int8' -> ('int8', None, 'auto');
    'kv-int8' -> ('none', None, 'int8'); 'int4+kv-int8' -> ('int4', None, 'int8')."""
    weights, kv_dtype = "none", "auto"
    for part in mode.split("+"):
        if part.startswith("kv-"):
            kv_dtype = part.removeprefix("kv-")
        else:
            weights = part
    name, _, group = weights.partition("-g")
    if group and not group.isdigit():
        raise ValueError(f"--modes: {mode!r}: a group size is written -g<inputs>, e.g. int4-g128")
    return name, int(group) if group else None, kv_dtype


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    if size < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {size}")
    return [token_ids[i : i + size] for i in range(0, len(token_ids), size) if len(token_ids[i : i + size]) >= 2]


def score(llm, chunks: list[list[int]]) -> tuple[list[float], list[int]]:
    """Log-probability of each scored token, and the model's top-1 token at each position."""
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=False)  # ids suffice
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    logprobs, top1 = [], []
    for chunk, out in zip(chunks, outs):
        for token, entry in zip(chunk[1:], out.prompt_logprobs[1:]):
            logprobs.append(entry[token].logprob)
            top1.append(max(entry, key=lambda t: entry[t].logprob))
    return logprobs, top1


def _mode_config(config, mode: str):
    """The engine options of one --modes entry (EngineConfig refuses an unknown method or KV dtype)."""
    method, group, kv_dtype = parse_mode(mode)
    return dataclasses.replace(config, quantization=method, kv_cache_dtype=kv_dtype,
                               quantization_group_size=group if group is not None else
                               (config.quantization_group_size if method in ("int8", "int4") else None))


def run(config, args: argparse.Namespace) -> list[ModeQuality]:
    from kvflow import LLM

    text = Path(args.text).read_text(encoding="utf-8")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise ValueError("--modes: give at least one mode")
    results: list[ModeQuality] = []
    baseline_top1: list[int] | None = None
    chunks = None
    mode_configs = [_mode_config(config, mode) for mode in modes]  # every mode checked before the first is scored
    for mode, mode_config in zip(modes, mode_configs):
        llm = LLM(**{f.name: getattr(mode_config, f.name) for f in dataclasses.fields(mode_config)})
        if chunks is None:
            chunks = windows(llm.get_tokenizer().encode(text, add_special_tokens=False), args.window)
        start = time.perf_counter()
        logprobs, top1 = score(llm, chunks)
        wall = time.perf_counter() - start
        baseline_top1 = top1 if baseline_top1 is None else baseline_top1
        agree = sum(a == b for a, b in zip(top1, baseline_top1)) / len(top1)
        plan = llm.engine.plan
        results.append(ModeQuality(mode, plan.weight_format, plan.kv_dtype_name, plan.weight_bytes, len(logprobs),
                                   math.exp(-sum(logprobs) / len(logprobs)), agree, wall))
        print(_row(results[-1], results[0]), flush=True)
        del llm
        gc.collect()
    if args.json:
        import json

        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    return results


def _row(r: ModeQuality, base: ModeQuality) -> str:
    delta = (r.perplexity / base.perplexity - 1) * 100
    return (f"{r.mode:<13} {r.weights:<34} KV {r.kv_cache_dtype:<8} weights {r.weight_bytes / 2**20:7.1f} MiB  "
            f"ppl {r.perplexity:8.4f} ({delta:+6.2f} %)  top-1 agreement {r.top1_agreement:6.1%}  "
            f"{r.num_scored} tokens in {r.wall_s:.1f} s")
