"""Latency arithmetic on hand-made timestamps, with the answers worked out by hand."""

from __future__ import annotations

import math

import pytest

from kvflow.bench import metrics as m
from kvflow.bench.serve import arrival_offsets, parse_rates
from kvflow.bench.serve_client import RequestRecord, apply_chunk, completion_payload, parse_event, ServeRequest
from kvflow.bench.serve_report import format_run, format_sweep, summarize_run


def test_request_latency_by_hand():
    lat = m.request_latency(10.0, [10.5, 10.6, 10.8, 11.1])
    assert lat.ttft == pytest.approx(0.5)
    assert lat.e2e == pytest.approx(1.1)
    assert lat.itls == pytest.approx([0.1, 0.2, 0.3])
    assert lat.tpot == pytest.approx((1.1 - 0.5) / 3)  # 0.2
    assert lat.output_tokens == 4


def test_tpot_divides_by_tokens_not_chunks():
    # Two chunks carrying 5 tokens: decode time 0.8 s over 4 tokens after the first.
    lat = m.request_latency(0.0, [0.2, 1.0], output_tokens=5)
    assert lat.tpot == pytest.approx(0.2)
    assert lat.itls == pytest.approx([0.8])


def test_single_token_has_no_tpot():
    lat = m.request_latency(1.0, [1.25])
    assert lat.ttft == pytest.approx(0.25) and lat.e2e == pytest.approx(0.25)
    assert lat.tpot is None and lat.itls == []


def test_no_tokens_is_an_error():
    with pytest.raises(ValueError):
        m.ttft(0.0, [])


def test_percentiles_linear_interpolation():
    p = m.percentiles(range(1, 11))
    assert p.count == 10
    assert p.mean == pytest.approx(5.5)
    assert p.p50 == pytest.approx(5.5)
    assert p.p90 == pytest.approx(9.1)  # rank 0.9 * 9 = 8.1 -> 9 + 0.1 * (10 - 9)
    assert p.p99 == pytest.approx(9.91)
    assert p.scaled(1000).p90 == pytest.approx(9100)


def test_percentiles_skip_none_and_handle_empty():
    assert m.percentiles([None, 2.0, None, 4.0]).mean == pytest.approx(3.0)
    empty = m.percentiles([])
    assert empty.count == 0 and math.isnan(empty.p50)
    assert empty.to_dict()["p50"] is None  # strict JSON


def test_goodput_counts_requests_meeting_every_slo():
    a = m.RequestLatency(ttft=0.5, e2e=1.0, tpot=0.2)
    b = m.RequestLatency(ttft=1.5, e2e=2.0, tpot=0.05)  # misses TTFT
    c = m.RequestLatency(ttft=0.2, e2e=1.0, tpot=0.3)  # misses TPOT
    d = m.RequestLatency(ttft=0.9, e2e=0.9, tpot=None)  # one token: no TPOT to miss
    reqs = [a, b, c, d]
    assert m.goodput(reqs, 2.0, slo_ttft_ms=1000, slo_tpot_ms=250) == pytest.approx(2 / 2.0)
    assert m.goodput(reqs, 2.0, slo_ttft_ms=1000) == pytest.approx(3 / 2.0)
    assert m.goodput(reqs, 2.0, slo_tpot_ms=250) == pytest.approx(3 / 2.0)
    assert m.goodput(reqs, 2.0) == pytest.approx(4 / 2.0)
    with pytest.raises(ValueError):
        m.goodput(reqs, 0.0)


# ---- the serving client's stream parsing and aggregation -------------------------------------
def test_parse_event_kinds():
    assert parse_event(" [DONE]").done
    tok = parse_event('{"choices":[{"text":"","logprobs":{"tokens":["a"]},"finish_reason":null}]}')
    assert tok.tokens == 1 and not tok.finished
    text = parse_event('{"choices":[{"text":"hi","finish_reason":"length"}]}')
    assert text.tokens == 1 and text.finished
    usage = parse_event('{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}')
    assert (usage.prompt_tokens, usage.completion_tokens, usage.tokens) == (7, 3, 0)
    assert parse_event('{"error":{"message":"boom"}}').error == "boom"
    assert parse_event("not json").error


def test_apply_chunk_ignores_a_trailing_empty_finish_chunk():
    rec = RequestRecord(start=0.0, requested_output=2, prompt_tokens=4)
    apply_chunk(rec, parse_event('{"choices":[{"text":"a","finish_reason":null}]}'), 0.1)
    apply_chunk(rec, parse_event('{"choices":[{"text":"b","finish_reason":null}]}'), 0.3)
    apply_chunk(rec, parse_event('{"choices":[{"text":"","finish_reason":"length"}]}'), 0.31)
    apply_chunk(rec, parse_event('{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}'), 0.32)
    assert rec.chunk_times == [0.1, 0.3] and rec.output_tokens == 2 and rec.ok


def test_apply_chunk_textless_stream_still_has_a_first_token():
    rec = RequestRecord(start=0.0, requested_output=3, prompt_tokens=4)
    apply_chunk(rec, parse_event('{"choices":[{"text":"","finish_reason":"length"}]}'), 0.5)
    apply_chunk(rec, parse_event('{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}'), 0.5)
    assert rec.chunk_times == [0.5] and rec.output_tokens == 3


def test_completion_payload_is_greedy_exact_length_streaming():
    p = completion_payload(ServeRequest([1, 2, 3], 3, 8), "m", logprobs=0)
    assert p["prompt"] == [1, 2, 3] and p["max_tokens"] == 8 and p["ignore_eos"] and p["stream"]
    assert p["temperature"] == 0.0 and p["logprobs"] == 0 and p["stream_options"] == {"include_usage": True}


def test_summarize_run_by_hand():
    good = RequestRecord(0.0, 3, 10, chunk_times=[0.1, 0.2, 0.4], output_tokens=3)
    other = RequestRecord(0.5, 3, 6, chunk_times=[0.8, 0.9, 1.0], output_tokens=3)
    failed = RequestRecord(0.0, 3, 10, error="HTTP 503: busy")
    r = summarize_run([good, other, failed], duration_s=1.0, request_rate=math.inf, slo_ttft_ms=200)
    assert (r.completed, r.failed, r.request_rate) == (2, 1, "inf")
    assert (r.prompt_tokens, r.output_tokens) == (16, 6)
    assert r.output_throughput == pytest.approx(6.0) and r.total_token_throughput == pytest.approx(22.0)
    assert r.ttft_ms.mean == pytest.approx((100 + 300) / 2)
    assert r.itl_ms.mean == pytest.approx((100 + 200 + 100 + 100) / 4)
    assert r.tpot_ms.p50 == pytest.approx((150 + 100) / 2)
    assert r.goodput == pytest.approx(1.0)  # only the first met TTFT <= 200 ms
    assert r.errors == ["HTTP 503: busy"]
    text = format_run(r)
    assert "TTFT" in text and "goodput" in text and "HTTP 503" in text
    assert "rate" in format_sweep([r])


def test_arrival_offsets_poisson_and_burst():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    offsets = arrival_offsets(4001, 10.0, seed=3)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / 4000 == pytest.approx(0.1, rel=0.08)  # mean gap 1/rate
    assert arrival_offsets(50, 10.0, seed=3) == offsets[:50]  # same seed, same schedule
    assert parse_rates("0.5,2,inf") == [0.5, 2.0, math.inf]
    with pytest.raises(ValueError):
        parse_rates("0")
