"""Latency arithmetic on timestamps, shared by every benchmark so they all define TTFT alike.

Everything here is a pure function of timestamps (seconds, one clock per request), so the
definitions can be unit-tested on hand-made numbers and a client-side benchmark and an
engine-side one report the same quantities:

  TTFT  first token time - request start
  ITL   the gaps between successive token (or stream chunk) arrivals
  TPOT  (E2E - TTFT) / (output tokens - 1): decode time per token after the first
  E2E   last token time - request start

Percentiles use numpy's default linear interpolation, as vLLM's benchmark does, so the same
latencies give the same p99 in either tool.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestLatency:
    """One finished request's latencies in seconds (tpot is None with fewer than 2 output tokens)."""

    ttft: float
    e2e: float
    tpot: float | None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class Percentiles:
    """mean / p50 / p90 / p99 of one quantity; NaN when there was nothing to measure."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    def scaled(self, factor: float) -> "Percentiles":
        """The same statistics in other units (e.g. x1000 for milliseconds)."""
        return Percentiles(self.count, self.mean * factor, self.p50 * factor, self.p90 * factor, self.p99 * factor)

    def to_dict(self) -> dict[str, float | int | None]:
        """JSON-safe: NaN (no samples) becomes null, since strict JSON has no NaN."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def ttft(start: float, token_times: Sequence[float]) -> float:
    if not token_times:
        raise ValueError("ttft: the request produced no tokens")
    return token_times[0] - start


def e2e(start: float, token_times: Sequence[float]) -> float:
    if not token_times:
        raise ValueError("e2e: the request produced no tokens")
    return token_times[-1] - start


def itls(token_times: Sequence[float]) -> list[float]:
    """Gaps between successive arrivals (one fewer than the arrivals)."""
    return [b - a for a, b in zip(token_times, token_times[1:])]


def tpot(ttft_s: float, e2e_s: float, output_tokens: int) -> float | None:
    """Decode time per output token after the first; undefined (None) for a single token."""
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def request_latency(start: float, token_times: Sequence[float], output_tokens: int | None = None,
                    prompt_tokens: int = 0) -> RequestLatency:
    """All of one request's latencies from its start and its token (or chunk) arrival times.

    `output_tokens` defaults to the number of arrivals; pass the true count when a chunk may
    carry several tokens, so TPOT divides by tokens, not chunks.
    """
    n = len(token_times) if output_tokens is None else output_tokens
    first, last = ttft(start, token_times), e2e(start, token_times)
    return RequestLatency(first, last, tpot(first, last, n), itls(token_times), n, prompt_tokens)


def percentiles(values: Iterable[float], qs: Sequence[float] = PERCENTILES) -> Percentiles:
    """Mean and the p50/p90/p99 (numpy linear interpolation) of the values, NaN if none."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        nan = float("nan")
        return Percentiles(0, nan, nan, nan, nan)
    p50, p90, p99 = (float(x) for x in np.percentile(arr, list(qs)))
    return Percentiles(int(arr.size), float(arr.mean()), p50, p90, p99)


def meets_slo(latency: RequestLatency, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    """A request counts toward goodput if it met every SLO given (a 1-token request has no TPOT to miss)."""
    if slo_ttft_s is not None and latency.ttft > slo_ttft_s:
        return False
    if slo_tpot_s is not None and latency.tpot is not None and latency.tpot > slo_tpot_s:
        return False
    return True


def goodput(latencies: Iterable[RequestLatency], duration_s: float, slo_ttft_ms: float | None = None,
            slo_tpot_ms: float | None = None) -> float:
    """Requests per second that met the SLOs (all finished requests when no SLO is given)."""
    if duration_s <= 0:
        raise ValueError(f"goodput: duration must be positive, got {duration_s}")
    ttft_s = None if slo_ttft_ms is None else slo_ttft_ms / 1e3
    tpot_s = None if slo_tpot_ms is None else slo_tpot_ms / 1e3
    return sum(1 for lat in latencies if meets_slo(lat, ttft_s, tpot_s)) / duration_s
