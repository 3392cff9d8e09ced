"""From timed request records to one serving run's numbers, and those numbers as text.

Kept apart from the HTTP client so that the arithmetic (which requests count, what the
duration is, what goodput means) can be tested without a server.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvflow.bench.metrics import Percentiles, RequestLatency, goodput, percentiles, request_latency
from kvflow.bench.serve_client import RequestRecord

MAX_ERRORS_KEPT = 5


@dataclass
class ServeRunResult:
    """One run at one request rate. Latencies in milliseconds, rates per second."""

    request_rate: float | str  # "inf" when all requests were sent at once
    max_concurrency: int | None
    num_prompts: int
    completed: int
    failed: int
    duration_s: float  # from the first send to the last token of the last request
    prompt_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    goodput: float | None = None  # requests/s meeting the SLOs; None when no SLO was given
    output_len_mismatches: int = 0  # finished requests whose length differs from max_tokens (ignore_eos ignored?)
    chunks_per_token: float = 1.0  # below 1: the server grouped tokens, so ITLs are per chunk
    errors: list[str] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            d[name] = getattr(self, name).to_dict()
        return d


def rate_label(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def summarize_run(records: list[RequestRecord], duration_s: float, request_rate: float,
                  max_concurrency: int | None = None, slo_ttft_ms: float | None = None,
                  slo_tpot_ms: float | None = None, save_itls: bool = False) -> ServeRunResult:
    """Aggregate a run: failed requests count in `failed` and nowhere else."""
    ok = [r for r in records if r.ok]
    lats: list[RequestLatency] = [request_latency(r.start, r.chunk_times, r.output_tokens, r.prompt_tokens) for r in ok]
    all_itls = [gap for lat in lats for gap in lat.itls]
    prompt = sum(lat.prompt_tokens for lat in lats)
    output = sum(lat.output_tokens for lat in lats)
    chunks = sum(len(r.chunk_times) for r in ok)
    duration = max(duration_s, 1e-9)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    details = []
    for lat in lats:
        row = {"ttft_s": lat.ttft, "tpot_s": lat.tpot, "e2e_s": lat.e2e, "prompt_tokens": lat.prompt_tokens,
               "output_tokens": lat.output_tokens}
        if save_itls:
            row["itls_s"] = lat.itls
        details.append(row)
    return ServeRunResult(
        request_rate=rate_label(request_rate), max_concurrency=max_concurrency, num_prompts=len(records),
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s, prompt_tokens=prompt,
        output_tokens=output, request_throughput=len(ok) / duration, output_throughput=output / duration,
        total_token_throughput=(prompt + output) / duration,
        ttft_ms=percentiles(lat.ttft for lat in lats).scaled(1e3),
        tpot_ms=percentiles(lat.tpot for lat in lats).scaled(1e3),
        itl_ms=percentiles(all_itls).scaled(1e3),
        e2e_ms=percentiles(lat.e2e for lat in lats).scaled(1e3),
        slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
        goodput=goodput(lats, duration, slo_ttft_ms, slo_tpot_ms) if has_slo else None,
        output_len_mismatches=sum(1 for r in ok if r.output_tokens != r.requested_output),
        chunks_per_token=chunks / output if output else 1.0,
        errors=[r.error for r in records if r.error][:MAX_ERRORS_KEPT],
        requests=details,
    )


def _fmt(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"


def format_run(r: ServeRunResult) -> str:
    """A plain-text block for one run, with the caveats that change how to read it."""
    conc = "unlimited" if r.max_concurrency is None else str(r.max_concurrency)
    lines = [
        f"==== serving benchmark: request rate {r.request_rate}/s, max concurrency {conc} ====",
        f"requests completed / failed:     {r.completed} / {r.failed}",
        f"duration:                        {r.duration_s:.2f} s",
        f"prompt / output tokens:          {r.prompt_tokens} / {r.output_tokens}",
        f"request throughput:              {r.request_throughput:.2f} req/s",
        f"output token throughput:         {r.output_throughput:.1f} tok/s",
        f"total token throughput:          {r.total_token_throughput:.1f} tok/s",
    ]
    if r.goodput is not None:
        slo = ", ".join(s for s in (f"TTFT <= {r.slo_ttft_ms} ms" if r.slo_ttft_ms is not None else "",
                                    f"TPOT <= {r.slo_tpot_ms} ms" if r.slo_tpot_ms is not None else "") if s)
        lines.append(f"goodput ({slo}): {r.goodput:.2f} req/s")
    lines.append(f"{'latency (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, p in (("TTFT", r.ttft_ms), ("TPOT", r.tpot_ms), ("ITL", r.itl_ms), ("E2E", r.e2e_ms)):
        lines.append(f"{name:<12}{_fmt(p.mean):>10}{_fmt(p.p50):>10}{_fmt(p.p90):>10}{_fmt(p.p99):>10}")
    if r.chunks_per_token < 0.9:
        lines.append(f"note: {r.chunks_per_token:.2f} stream chunks per output token; ITLs are per chunk "
                     "(try --logprobs 0 for one chunk per token)")
    if r.output_len_mismatches:
        lines.append(f"warning: {r.output_len_mismatches} requests did not generate exactly max_tokens "
                     "(does the server honour ignore_eos?)")
    for err in r.errors:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def format_sweep(results: list[ServeRunResult]) -> str:
    """One row per rate: the table to read a throughput/latency curve from."""
    head = (f"{'rate':>6} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
            f"{'TPOT p99':>9} {'ITL p50':>8} {'goodput':>8} {'failed':>6}")
    rows = [head]
    for r in results:
        good = "-" if r.goodput is None else f"{r.goodput:.2f}"
        rows.append(f"{str(r.request_rate):>6} {r.request_throughput:>7.2f} {r.output_throughput:>10.1f} "
                    f"{_fmt(r.ttft_ms.p50):>9} {_fmt(r.ttft_ms.p99):>9} {_fmt(r.tpot_ms.p50):>9} "
                    f"{_fmt(r.tpot_ms.p99):>9} {_fmt(r.itl_ms.p50):>8} {good:>8} {r.failed:>6}")
    return "latencies in ms\n" + "\n".join(rows)
