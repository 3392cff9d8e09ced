"""Benchmark request sets. `random` reproduces the W-offline workload definition exactly."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

# The published workloads' token ids (../shared/workloads/README.md): W-offline, W-latency, W-prefix.
WORKLOAD_TOKEN_RANGE = (1000, 40000)


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(
    num_prompts: int = 32,
    input_len: tuple[int, int] = (32, 512),
    output_len: tuple[int, int] = (32, 256),
    seed: int = 0,
    token_range: tuple[int, int] = WORKLOAD_TOKEN_RANGE,
) -> list[BenchRequest]:
    """Lengths drawn first, then each prompt in order, as W-offline specifies (bounds inclusive)."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(input_len[0], input_len[1] + 1, num_prompts)
    output_lens = rng.integers(output_len[0], output_len[1] + 1, num_prompts)
    return [
        BenchRequest(rng.integers(token_range[0], token_range[1], size=int(n)).tolist(), int(m))
        for n, m in zip(prompt_lens, output_lens)
    ]


def prefix_requests(
    num_prompts: int = 32, prefix_len: int = 1024, suffix_len: int = 64, output_len: int = 32,
    seed: int = 2, token_range: tuple[int, int] = WORKLOAD_TOKEN_RANGE,
) -> list[BenchRequest]:
    """N requests sharing one system prompt (W-prefix: prefix from default_rng(2), suffixes from seed+1)."""
    prefix = np.random.default_rng(seed).integers(token_range[0], token_range[1], size=prefix_len).tolist()
    rng = np.random.default_rng(seed + 1)
    return [
        BenchRequest(prefix + rng.integers(token_range[0], token_range[1], size=suffix_len).tolist(), output_len)
        for _ in range(num_prompts)
    ]


def jsonl_requests(path: str, tokenizer, default_output_len: int = 128) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": str} or {"prompt_token_ids": [...]}, optional "output_len"."""
    requests = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt_token_ids" in row:
                ids = [int(t) for t in row["prompt_token_ids"]]
            elif "prompt" in row:
                if tokenizer is None:
                    raise ValueError(f"{path}:{line_no}: text prompts need a model with a tokenizer")
                ids = tokenizer(row["prompt"]).input_ids
            else:
                raise ValueError(f"{path}:{line_no}: needs 'prompt' or 'prompt_token_ids'")
            requests.append(BenchRequest(ids, int(row.get("output_len", default_output_len))))
    return requests


def random_like(requests: list[BenchRequest], seed: int, token_range: tuple[int, int]) -> list[BenchRequest]:
    """Random ids of the same prompt and output lengths as `requests`.

    The warm-up for a request set with no second draw (a JSONL file): warming up on the timed
    prompts themselves would leave them in the prefix cache, which then serves the timed run."""
    rng = np.random.default_rng(seed)
    return [BenchRequest(rng.integers(token_range[0], token_range[1], size=len(r.prompt_token_ids)).tolist(),
                         r.output_len) for r in requests]


def grounded_requests(tokenizer, num_prompts: int = 16, seed: int = 0, output_len: int = 128,
                      exclude: list[BenchRequest] | tuple = ()) -> list[BenchRequest]:
    """W-grounded: chat prompts over kvflow's own source whose answers quote the prompt (code edits,
    extraction, summaries), for speculative decoding. See `kvflow.bench.grounded`; pass the timed
    set as `exclude` when drawing a warm-up set, so the two share no passage."""
    from kvflow.bench import grounded

    if tokenizer is None:
        raise ValueError("the grounded workload needs a model with a tokenizer and a chat template")
    return grounded.grounded_requests(tokenizer, num_prompts, seed, output_len, exclude)


def fit_token_range(token_range: tuple[int, int], vocab_size: int) -> tuple[int, int]:
    """The workload's token-id range, shrunk into a vocabulary too small for it.

    The published workloads draw ids from [1000, 40000), which only fits vocabularies of at
    least 40,000 tokens; a smaller model (tests' tiny ones) would reject such prompts. The
    range is returned unchanged whenever it fits, so the standard workloads stay exact.
    """
    low, high = token_range
    if high <= vocab_size:
        return low, high
    return min(low, vocab_size // 2), vocab_size


def parse_token_range(text: str) -> tuple[int, int]:
    """'LOW,HIGH' (HIGH exclusive) from the command line."""
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"token range: expected LOW,HIGH, got {text!r}") from None
    if not 0 <= low < high:
        raise ValueError(f"token range: need 0 <= LOW < HIGH, got {text!r}")
    return low, high
