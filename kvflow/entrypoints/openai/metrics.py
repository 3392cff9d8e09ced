"""Prometheus metrics for the server, named like vLLM's (`kvflow:` instead of `vllm:`).

Dashboards and alerts written for vLLM then work after a prefix substitution. Each app gets
its own `CollectorRegistry` (tests and embedders build several apps in one process, and the
global registry refuses duplicate names). Latency histograms are fed per request from the
engine's own timestamps as outputs arrive, so a slow client does not inflate them; gauges
and counters are refreshed from `EngineStats` on each scrape, counters by the increase of
the engine's running totals since the previous scrape.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)

from kvflow.engine.request_state import EngineStats
from kvflow.outputs import PoolingRequestOutput, RequestOutput
from kvflow.spec_decode.speculator import SpecDecodeStats

PREFIX = "kvflow:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)

# EngineStats totals mirrored as Prometheus counters: (stats field, metric name, help).
_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "num_preemptions", "Sequences preempted for lack of KV blocks."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of requests that produced a first token."),
    ("generation_tokens", "generation_tokens", "Generated tokens."),
    ("prefill_tokens", "prefill_tokens", "Prompt tokens the model computed: prefix-cache hits and prompt blocks "
     "shared by parallel samples excluded, prompts recomputed after a preemption included."),
)


class ServerMetrics:
    """All of one app's metrics, in one registry, labelled with the served model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             _ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Per request: decode time divided by the tokens after the first.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time from arrival to first scheduling.",
                               _REQUEST_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self._counters = {
            stat: Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)
            for stat, name, doc in _COUNTERS
        }
        self._last_totals = {stat: 0 for stat, _, _ in _COUNTERS}
        self._spec: _SpecDecodeMetrics | None = None  # registered once speculation reports (only when on)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.recent = RecentLatencies()

    def refresh(self, stats: EngineStats) -> None:
        """Bring the gauges and counters up to date with the engine's latest snapshot."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        for stat, counter in self._counters.items():
            total = int(getattr(stats, stat))
            delta = total - self._last_totals[stat]
            if delta > 0:
                counter.inc(delta)
                self._last_totals[stat] = total

        if stats.spec_decode is not None:
            if self._spec is None:
                self._spec = _SpecDecodeMetrics(self.registry, self.model_name)
            self._spec.refresh(stats.spec_decode)

    def render(self, stats: EngineStats) -> bytes:
        self.refresh(stats)
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class _SpecDecodeMetrics:
    """Speculative decoding, named like vLLM's: counters to rate() plus the running ratios."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *extra], registry=registry)

        self.drafts = counter("spec_decode_num_drafts", "Sequence-steps that verified draft tokens.").labels(model_name)
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.").labels(model_name)
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(model_name)
        self.per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
                               ("position",))
        self.rate = Gauge(PREFIX + "spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start.",
                          ["model_name"], registry=registry).labels(model_name)
        self.mean_len = Gauge(PREFIX + "spec_decode_mean_accepted_length",
                              "Tokens emitted per speculative step (accepted drafts + 1) since start.",
                              ["model_name"], registry=registry).labels(model_name)
        self._last = SpecDecodeStats()

    def refresh(self, stats: SpecDecodeStats) -> None:
        delta = stats.since(self._last)
        self.drafts.inc(delta.num_spec_steps)
        self.draft_tokens.inc(delta.num_draft_tokens)
        self.accepted.inc(delta.num_accepted_tokens)
        for position, count in enumerate(delta.accepted_per_position):
            self.per_pos.labels(self.model_name, str(position)).inc(count)
        self.rate.set(stats.acceptance_rate)
        self.mean_len.set(stats.mean_accepted_length)
        self._last = copy.deepcopy(stats)


class RecentLatencies:
    """The last few minutes of TTFT and ITL observations, for the dashboard's charts (the
    histograms above hold everything since start, which a chart of "now" cannot use)."""

    def __init__(self, window_s: float = 300.0, max_samples: int = 50_000) -> None:
        self.window_s = window_s
        self._ttft: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._itl: deque[tuple[float, float, int]] = deque(maxlen=max_samples)  # (time, gap, tokens)

    def add_ttft(self, when: float, seconds: float) -> None:
        self._ttft.append((when, seconds))

    def add_itl(self, when: float, seconds: float, tokens: int) -> None:
        self._itl.append((when, seconds, tokens))

    def series(self, now: float, bucket_s: float = 5.0) -> dict[str, list]:
        """Per `bucket_s` slice of the window, oldest first: median TTFT and ITL (seconds, None
        for an empty slice) and generated tokens per second."""
        num = int(self.window_s // bucket_s)
        start = now - num * bucket_s
        ttft: list[list[float]] = [[] for _ in range(num)]
        itl: list[list[float]] = [[] for _ in range(num)]
        tokens = [0] * num
        for when, value in self._ttft:
            if when >= start:
                i = min(int((when - start) // bucket_s), num - 1)
                ttft[i].append(value)
                tokens[i] += 1
        for when, value, count in self._itl:
            if when >= start:
                i = min(int((when - start) // bucket_s), num - 1)
                itl[i].append(value)
                tokens[i] += count
        median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        return {"bucket_s": bucket_s, "ttft_p50": [median(x) for x in ttft], "itl_p50": [median(x) for x in itl],
                "tokens_per_s": [n / bucket_s for n in tokens]}


@dataclass
class RequestTracker:
    """Feeds one request's latencies into the histograms as its outputs arrive.

    A request with n > 1 reports all its samples in one output: tokens are counted over every
    sample (the throughput), a step's gap is divided by the tokens one sample gained in it (the
    inter-token latency a sample sees), and each sample's finish reason is counted."""

    metrics: ServerMetrics
    num_tokens: int = 0  # over all samples
    last_token_time: float | None = None
    done: bool = field(default=False)
    sample_tokens: list[int] = field(default_factory=list)

    def on_output(self, out: RequestOutput | PoolingRequestOutput) -> None:
        if isinstance(out, PoolingRequestOutput):  # an embedding: one output, no tokens
            self._on_pooled(out)
            return
        m, t = self.metrics, out.metrics
        counts = [len(c.token_ids) for c in out.outputs]
        previous = self.sample_tokens + [0] * (len(counts) - len(self.sample_tokens))
        new = max(sum(counts) - self.num_tokens, 1)
        per_sample = max([c - p for c, p in zip(counts, previous)] + [1])
        now = t.last_token_time or time.time()
        if self.num_tokens == 0:
            first = t.first_token_time or now
            m.ttft.observe(max(first - t.arrival_time, 0.0))
            m.recent.add_ttft(first, max(first - t.arrival_time, 0.0))
            if t.first_scheduled_time is not None:
                m.queue.observe(max(t.first_scheduled_time - t.arrival_time, 0.0))
            self.last_token_time = first
            new, per_sample = new - 1, per_sample - 1
        if new > 0 and self.last_token_time is not None:
            gap = max(now - self.last_token_time, 0.0) / max(per_sample, 1)
            for _ in range(new):
                m.itl.observe(gap)
            m.recent.add_itl(now, gap, new)
            self.last_token_time = now
        self.num_tokens, self.sample_tokens = sum(counts), counts
        if out.finished and not self.done:
            self.done = True
            end = t.finished_time or now
            m.e2e.observe(max(end - t.arrival_time, 0.0))
            longest = max(counts, default=0)
            if longest > 1 and t.first_token_time is not None:
                m.tpot.observe(max(end - t.first_token_time, 0.0) / (longest - 1))
            for c in out.outputs:
                m.request_success.labels(m.model_name, c.finish_reason or "unknown").inc()

    def _on_pooled(self, out: PoolingRequestOutput) -> None:
        m, t = self.metrics, out.metrics
        if t is not None:
            if t.first_scheduled_time is not None:
                m.queue.observe(max(t.first_scheduled_time - t.arrival_time, 0.0))
            m.e2e.observe(max((t.finished_time or time.time()) - t.arrival_time, 0.0))
        self.done = True
        m.request_success.labels(m.model_name, "stop").inc()
