"""The server's per-request latency tracker (metrics.RequestTracker) on hand-made outputs: one
sample, and n = 3 samples reported together, where tokens must be counted over every sample
and the inter-token gap per sample, and each sample's finish reason counted."""

from __future__ import annotations

from kvflow.entrypoints.openai.metrics import ServerMetrics
from kvflow.outputs import CompletionOutput, RequestMetrics, RequestOutput


def output(token_counts: list[int], now: float, finished: bool = False) -> RequestOutput:
    comps = [CompletionOutput(i, "", list(range(n)), None, None, "length" if finished else None)
             for i, n in enumerate(token_counts)]
    return RequestOutput("r", None, [1, 2], comps, finished,
                         RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=1.0,
                                        last_token_time=now, finished_time=now if finished else None))


def histogram(metrics: ServerMetrics, name: str) -> tuple[float, float]:
    """(count, sum) of one of the registry's histograms."""
    values = {s.name: s.value for fam in metrics.registry.collect() for s in fam.samples}
    return values[f"kvflow:{name}_count"], values[f"kvflow:{name}_sum"]


def test_one_sample():
    m = ServerMetrics("x")
    tracker = m.tracker()
    for i, now in enumerate((1.0, 1.5, 2.0), start=1):
        tracker.on_output(output([i], now, finished=i == 3))
    assert histogram(m, "inter_token_latency_seconds") == (2, 1.0)  # two gaps of 0.5 s
    assert histogram(m, "time_to_first_token_seconds") == (1, 1.0)
    assert histogram(m, "request_time_per_output_token_seconds") == (1, 0.5)


def test_three_samples_count_every_token_and_gap_per_sample():
    m = ServerMetrics("x")
    tracker = m.tracker()
    tracker.on_output(output([1, 0, 0], 1.0))  # sample 0's first token; the others join after it
    tracker.on_output(output([2, 1, 1], 1.5))  # 3 new tokens, 1 per sample: gap 0.5 s
    tracker.on_output(output([3, 2, 2], 2.0, finished=True))
    count, total = histogram(m, "inter_token_latency_seconds")
    assert count == 6 and abs(total - 3.0) < 1e-9  # six tokens after the first, each 0.5 s apart
    assert sum(m.recent.series(3.0)["tokens_per_s"]) * 5.0 == 7  # every sample's tokens, the first included
    assert histogram(m, "request_time_per_output_token_seconds") == (1, 0.5)  # per sample: 1 s over 2 tokens
    finished = {s.labels["finished_reason"]: s.value for fam in m.registry.collect() for s in fam.samples
                if s.name == "kvflow:request_success_total"}
    assert finished == {"length": 3}
