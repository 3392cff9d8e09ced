"""`kvflow bench serve` against kvflow's own server on a tiny model.

The client's latencies are checked against what the server measured for the same requests
(its Prometheus histograms): a client that mis-timed chunks, or a server that mis-recorded
them, would disagree. The client's TTFT encloses the server's (it adds the HTTP round trip),
so it may only be larger, by network and parsing slack.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.config import EngineConfig
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.cli import main
from kvflow.entrypoints.openai.server import build_app
from tests.entrypoints.conftest import httpx, serving

MODEL = "tiny"
API_KEY = "bench-key"
VOCAB_RANGE = "10,300"  # the tiny model has 320 tokens
WORKLOAD = ["--input-len-min", "8", "--input-len-max", "32", "--output-len-min", "8", "--output-len-max", "16",
            "--token-range", VOCAB_RANGE, "--logprobs", "0", "--no-progress"]


@pytest.fixture(scope="module")
def server(tiny_models):
    path, _ = tiny_models("llama")
    engine = AsyncEngine.from_config(EngineConfig(model=path, dtype="float32", kv_cache_memory=8 << 20,
                                                  max_model_len=256, num_threads=1))
    try:
        with serving(build_app(engine, MODEL, API_KEY)) as port:
            yield f"http://127.0.0.1:{port}"
    finally:
        engine.shutdown()


def scrape(base_url: str) -> dict[str, float]:
    """{sample name: value} of the kvflow histograms' _sum and _count."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")) and sample.name.startswith("kvflow:"):
                values[sample.name] = sample.value
    return values


def server_mean(before: dict, after: dict, name: str) -> tuple[float, float]:
    count = after[f"kvflow:{name}_count"] - before.get(f"kvflow:{name}_count", 0.0)
    total = after[f"kvflow:{name}_sum"] - before.get(f"kvflow:{name}_sum", 0.0)
    return total / count, count


def test_client_latencies_agree_with_server_metrics(server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    before = scrape(server)
    args = ["bench", "serve", "--base-url", server, "--api-key", API_KEY, "--num-prompts", "8", "--request-rate", "inf",
            "--max-concurrency", "4", "--num-warmups", "0", "--slo-ttft-ms", "10000", "--slo-tpot-ms", "10000",
            *WORKLOAD, "--output", str(out)]
    assert main(args) == 0
    after = scrape(server)
    report = json.loads(out.read_text())
    run = report["runs"][0]
    assert report["model"] == MODEL  # found through /v1/models
    assert run["completed"] == 8 and run["failed"] == 0 and run["output_len_mismatches"] == 0
    assert run["chunks_per_token"] == pytest.approx(1.0)  # --logprobs 0: one chunk per token
    assert run["goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs: everyone meets them
    assert run["output_tokens"] == sum(r["output_tokens"] for r in run["requests"])

    ttft_server, n_ttft = server_mean(before, after, "time_to_first_token_seconds")
    itl_server, n_itl = server_mean(before, after, "inter_token_latency_seconds")
    assert n_ttft == 8 and n_itl == run["output_tokens"] - 8  # the server saw exactly this run
    ttft_client = run["ttft_ms"]["mean"] / 1e3
    itl_client = run["itl_ms"]["mean"] / 1e3
    assert ttft_client >= ttft_server - 1e-3  # the client's span encloses the server's
    # The client, the server and its engine share this process (and its GIL): a slow CI
    # machine adds tens of ms to the client's side alone, so the bound is loose.
    assert ttft_client - ttft_server <= max(0.25, 0.5 * ttft_server)
    assert abs(itl_client - itl_server) <= max(0.05, 0.2 * itl_server)
    printed = capsys.readouterr().out
    assert "request throughput" in printed and "goodput" in printed and "p99" in printed


def test_sweep_draws_a_png(server, tmp_path, capsys):
    plot, out = tmp_path / "docs" / "sweep.png", tmp_path / "sweep.json"
    args = ["bench", "serve", "--base-url", server, "--api-key", API_KEY, "--model", MODEL, "--num-prompts", "4",
            "--sweep", "50,inf",
            *WORKLOAD, "--plot", str(plot), "--output", str(out)]
    assert main(args) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(out.read_text())
    assert [r["request_rate"] for r in report["runs"]] == [50.0, "inf"]
    assert report["run_seeds"] == [0, 1]  # every run of a sweep times fresh prompts
    assert all(r["completed"] == 4 for r in report["runs"])
    assert "out tok/s" in capsys.readouterr().out


def test_refused_requests_are_reported_not_hidden(server, tmp_path):
    out = tmp_path / "bad.json"
    # Token ids beyond the vocabulary: the server refuses every request with HTTP 400.
    args = ["bench", "serve", "--base-url", server, "--api-key", API_KEY, "--model", MODEL, "--num-prompts", "2",
            "--num-warmups", "0",
            "--token-range", "1000,2000", "--no-progress", "--output", str(out)]
    assert main(args) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 0 and run["failed"] == 2 and "HTTP 400" in run["errors"][0]


def test_wrong_api_key_is_one_clear_error(server, capsys):
    assert main(["bench", "serve", "--base-url", server, "--api-key", "wrong", "--no-progress"]) == 2
    assert "HTTP 401" in capsys.readouterr().err


def test_sse_lines_splits_the_raw_stream_on_newlines():
    from kvflow.bench.serve_client import sse_lines

    text = 'data: {"t": "é"}\r\n\r\ndata: [DONE]\n\ntrailing'.encode()
    cut = text.index("é".encode()) + 1  # a chunk boundary inside a two-byte character

    class Response:  # the one method sse_lines reads
        def __init__(self, pieces: list[bytes]) -> None:
            self.pieces = pieces

        async def aiter_bytes(self):
            for piece in self.pieces:
                yield piece

    async def collect(pieces: list[bytes]) -> list[bytes]:
        return [line async for line in sse_lines(Response(pieces))]

    want = ['data: {"t": "é"}'.encode(), b"", b"data: [DONE]", b"", b"trailing"]
    assert asyncio.run(collect([text[:cut], text[cut:cut + 9], text[cut + 9:]])) == want
    # one byte a chunk: lines spread over many chunks, \r and \n in different ones, empty chunks between
    assert asyncio.run(collect([piece for i in range(len(text)) for piece in (text[i:i + 1], b"")])) == want


def test_a_refused_connection_is_recorded_not_raised():
    from kvflow.bench.serve_client import ServeRequest, completion_payload, httpx, send_request

    with socket.socket() as s:  # a port nobody listens on once this socket closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def run():
        async with httpx.AsyncClient(timeout=5.0) as client:
            return await send_request(client, f"http://127.0.0.1:{port}/v1/completions",
                                      completion_payload(ServeRequest([1, 2, 3], 3, 4), "m"))

    record = asyncio.run(run())
    assert not record.ok and record.error.startswith("ConnectError"), record.error
