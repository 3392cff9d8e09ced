"""The offline benchmarks' result record and the memory readings it carries.

`throughput` (kvflow) and `hf_baseline` (transformers) both fill a `ThroughputResult`,
so it lives here, below both, and neither imports the other for it.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field


@dataclass
class ThroughputResult:
    engine: str
    dtype: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    requests_per_s: float
    total_tokens_per_s: float
    output_tokens_per_s: float
    peak_rss_mb: float
    peak_kv_usage: float = 0.0
    preemptions: int = 0
    computed_tokens: int = 0
    mean_ttft_s: float = 0.0
    spec_decode: str | None = None  # what speculative decoding did, when it was on
    # Each step's [tokens, logits_rows, attention_pairs, kv_tokens_read] (engine/step_shape.py), in
    # order: what `bench roofline` needs for the run's attainable floor. Empty for a baseline engine.
    steps: list[list[int]] = field(default_factory=list)

    def summary(self) -> str:
        spec = f"\n  {self.spec_decode}" if self.spec_decode else ""
        return (
            f"{self.engine} ({self.dtype}): {self.num_requests} requests, {self.prompt_tokens} prompt + "
            f"{self.output_tokens} output tokens in {self.wall_s:.2f} s\n"
            f"  {self.requests_per_s:.2f} req/s, {self.total_tokens_per_s:.1f} total tok/s, "
            f"{self.output_tokens_per_s:.1f} output tok/s\n"
            f"  peak RSS {self.peak_rss_mb:.0f} MB, peak KV usage {self.peak_kv_usage:.1%}, "
            f"preemptions {self.preemptions}, tokens computed {self.computed_tokens}, mean TTFT {self.mean_ttft_s * 1e3:.0f} ms"
        ) + spec


def numerics_label(engine) -> str:
    """The activations' dtype, and the weights' quantization and KV cache dtype when they
    differ from it: what a result was measured with (e.g. "float32, weights gguf (Q4_1, as
    shipped), KV int8")."""
    label = str(engine.dtype).removeprefix("torch.")
    weights = engine.plan.weight_format
    if weights != "none":
        label += f", weights {weights}"
    if engine.plan.kv_cache_dtype != "auto":
        label += f", KV {engine.plan.kv_cache_dtype}"
    return label


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def current_rss_mb() -> float:
    """Resident memory now (not the peak), to see whether repeated runs grow."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")
