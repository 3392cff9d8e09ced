"""`kvflow router` over two real `kvflow serve` processes on loopback ports (a tiny random Llama).

The routers run in the test process (uvicorn in threads); the instances are real processes so
that killing one is a real death. Instance A is a KV producer on the in-process engine, B a KV
consumer on the engine core process, so one pair serves both modes: data-parallel (A and B as
equals) and disaggregated (prefill on A, decode on B). Checked: answers through the router equal
the in-process `LLM`'s, streams pass through, prompts sharing a prefix land on one instance,
/metrics and /health aggregate, a disaggregated request computes only its prompt's tail on the
decode instance, and a dead instance is routed around (a dead prefill: decode computes it), then
reported.

test_router_refusals.py runs the router over in-process fakes, for what a real instance does not
do on cue.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvflow.entrypoints.router import Router, build_router_app
from kvflow.entrypoints.routing import (CacheAwarePolicy, Instance, RoundRobinPolicy, chunk_hashes, prompt_key,
                                       prompt_namespace)

from ..conftest import save_tiny_llama
from .conftest import eventually, httpx, serving

ROOT = Path(__file__).resolve().parents[2]
NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(model: str, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--model", model, "--dtype", "float32",
           "--port", str(port), "--served-model-name", NAME, "--kv-cache-memory", "8MiB", "--num-threads", "1",
           "--uvicorn-log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(procs: list[tuple[subprocess.Popen, str]], logs: list[Path], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    pending = list(zip(procs, logs))
    while pending:
        (proc, url), log = pending[0]
        assert proc.poll() is None, f"kvflow serve exited early:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    model, _ = save_tiny_llama(tmp / "model")
    logs = [tmp / "a.log", tmp / "b.log"]
    # The producer's token budget (32) computes a 69-token prompt over three steps: its blocks stream.
    procs = [start_serve(model, logs[0], "--in-process-engine", "--max-num-batched-tokens", "32",
                         "--kv-transfer-config", '{"kv_role": "kv_producer"}'),
             start_serve(model, logs[1], "--kv-transfer-config", '{"kv_role": "kv_consumer", "kv_timeout_s": 5}')]
    try:
        wait_healthy(procs, logs)
        router = Router([url for _, url in procs], "cache_aware")
        pd_router = Router([procs[1][1]], "cache_aware", prefill_urls=[procs[0][1]], prefill_timeout=20)
        with serving(build_router_app(router)) as port, serving(build_router_app(pd_router)) as pd_port, \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            http.pd_url = f"http://127.0.0.1:{pd_port}"  # type: ignore[attr-defined]
            http.model = model  # type: ignore[attr-defined]
            yield procs, router, http
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def prompts(prefix_seed: int, n: int) -> list[list[int]]:
    prefix = [(prefix_seed * 37 + 11 * i) % 300 + 3 for i in range(64)]
    return [prefix + [(prefix_seed + 7 * j + k) % 300 + 3 for k in range(5)] for j in range(n)]


def complete(http, url: str, prompt: list[int], **kw) -> dict:
    r = http.post(url + "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 8,
                                                  "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_answers_and_streams_pass_through(cluster):
    procs, router, http = cluster
    prompt = prompts(1, 1)[0]
    direct = complete(http, procs[0][1], prompt)["choices"][0]["text"]
    assert complete(http, "", prompt)["choices"][0]["text"] == direct
    with http.stream("POST", "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 8,
                                                      "temperature": 0, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == direct
    assert http.get("/v1/models").json()["data"][0]["id"] == NAME
    for url in ("", http.pd_url):  # embeddings are routed too, never split into prefill and decode
        embedded = http.post(url + "/v1/embeddings", json={"model": NAME, "input": [prompt, prompt[:9]]})
        assert embedded.status_code == 200, embedded.text
        direct = httpx.post(procs[1][1] + "/v1/embeddings", json={"model": NAME, "input": [prompt, prompt[:9]]})
        assert embedded.json()["data"] == direct.json()["data"]
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        via, direct = http.post(path, json=body), httpx.post(procs[1][1] + path, json=body)
        assert (via.status_code, via.json()) == (direct.status_code, direct.json())  # no tokenizer here: a 400
    # A client that leaves mid-stream: the router closes the upstream, the instance aborts and frees.
    body = {"model": NAME, "prompt": prompt, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break
    deadline = time.monotonic() + 10
    while any(gauge(url, "kvflow:num_requests_running") or gauge(url, "kvflow:kv_cache_usage_perc")
              for _, url in procs):
        assert time.monotonic() < deadline, "an instance kept the abandoned request"
        time.sleep(0.1)


def gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_shared_prefixes_stay_on_one_instance(cluster):
    procs, router, http = cluster
    before = [i.requests_total for i in router.instances]
    for group in (2, 3):
        counts = [i.requests_total for i in router.instances]
        for prompt in prompts(group, 4):
            complete(http, "", prompt)
        grew = [i.requests_total - c for i, c in zip(router.instances, counts)]
        assert sorted(grew) == [0, 4], grew  # the whole group on one instance
    assert sum(i.requests_total for i in router.instances) - sum(before) == 8
    metrics = http.get("/metrics").text
    for _, url in procs:
        assert f'instance="{url}"' in metrics and f'kvflow_router_instance_up{{instance="{url}"}} 1' in metrics
    # The first request of each prompt family was placed by load, every later one (the first
    # test's embeddings request and abandoned stream included) by its cached prefix.
    assert 'kvflow_router_decisions_total{reason="load"} 3' in metrics
    assert 'kvflow_router_decisions_total{reason="cache"} 9' in metrics
    assert http.get("/health").json()["status"] == "ok"


def prefill_tokens(url: str) -> int:
    text = httpx.get(url + "/metrics").text
    return int(sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvflow:prefill_tokens_total")))


def test_disaggregated_prefill_moves_the_prompt_blocks(cluster):
    from kvflow import LLM, SamplingParams

    procs, router, http = cluster
    ref_llm = LLM(http.model, dtype="float32", kv_cache_memory=8 << 20)
    prompt = prompts(6, 1)[0]  # 69 tokens: 4 full blocks move, the last 5 tokens are computed on B
    ref = ref_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)[0].outputs[0].text
    before = prefill_tokens(procs[1][1])
    assert complete(http, http.pd_url, prompt)["choices"][0]["text"] == ref
    # B's split-process core refreshes what its API process reports on an idle tick (50 ms):
    # read until the request shows, then check what it shows.
    assert eventually(lambda: prefill_tokens(procs[1][1]) != before)
    assert prefill_tokens(procs[1][1]) - before == 5
    assert eventually(lambda: httpx.get(procs[1][1] + "/kv_transfer").json()["stats"]["blocks"] > 0)
    info = httpx.get(procs[1][1] + "/kv_transfer").json()
    assert info["kv_role"] == "kv_consumer" and info["stats"]["blocks"] == 4 and info["stats"]["failures"] == 0
    assert info["stats"]["chunks"] >= 1  # 2 when the consumer subscribed before the first prefill step ended
    # A stream through the disaggregated path, on a prompt B has not seen.
    prompt = prompts(7, 1)[0]
    ref = ref_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)[0].outputs[0].text
    with httpx.stream("POST", http.pd_url + "/v1/completions", json={
            "model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == ref
    assert httpx.get(http.pd_url + "/health").json()["status"] == "ok"
    bad = httpx.post(procs[0][1] + "/v1/completions", json={"model": NAME, "prompt": [5, 6], "max_tokens": 2,
                                                            "kv_transfer_params": {"do_remote_prefill": True}})
    assert bad.status_code == 400 and "not a kv_consumer" in bad.json()["error"]["message"]
    # A salted request is served whole by the decode instance (its blocks are keyed by the salt), and
    # a consumer handed one with kv_transfer_params computes the prompt itself instead of waiting.
    prompt = prompts(8, 1)[0]
    ref = ref_llm.generate([{"prompt_token_ids": prompt, "cache_salt": "t1"}],
                           SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert complete(http, http.pd_url, prompt, cache_salt="t1")["choices"][0]["text"] == ref
    direct = complete(http, procs[1][1], prompt, cache_salt="t2", kv_transfer_params={
        "do_remote_prefill": True, "remote_kv_addr": info.get("kv_addr") or "tcp://127.0.0.1:1"})
    assert direct["choices"][0]["text"] == ref
    salted = httpx.post(procs[0][1] + "/v1/completions", json={
        "model": NAME, "prompt": [5, 6], "max_tokens": 2, "cache_salt": "t1",
        "kv_transfer_params": {"do_remote_decode": True}})
    assert salted.status_code == 400 and "cache_salt" in salted.json()["error"]["message"]


def test_dead_instance_is_routed_around_then_reported(cluster):
    """Last in the module: kill one instance (the producer), then the other."""
    procs, router, http = cluster
    procs[0][0].kill()
    procs[0][0].wait(10)
    for prompt in prompts(4, 3) + prompts(5, 3):  # whichever instance the policy picks, all succeed
        complete(http, "", prompt)
    before = prefill_tokens(procs[1][1])
    prompt = prompts(8, 1)[0]
    assert complete(http, http.pd_url, prompt)["choices"]  # the prefill instance is gone: B computes it all
    assert prefill_tokens(procs[1][1]) - before == len(prompt)
    health = http.get("/health").json()
    assert health["status"] == "degraded" and [s["healthy"] for s in health["instances"]] == [False, True]
    procs[1][0].kill()
    procs[1][0].wait(10)
    r = http.post("/v1/completions", json={"model": NAME, "prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert http.get("/health").status_code == 503


def test_policy_prefers_the_longest_prefix_and_balances_load():
    a, b = Instance("a"), Instance("b")
    policy = CacheAwarePolicy(cache_threshold=0.5, balance_abs=4, balance_rel=1.5)
    long_prompt = list(range(3, 3 + 160))
    first = policy.choose([a, b], long_prompt).instance
    assert policy.choose([a, b], long_prompt[:150] + [1] * 10).instance is first  # 9 of 10 chunks match
    other = b if first is a else a
    assert policy.choose([a, b], [9] * 160).instance is other  # no match: the one with the smaller record
    first.in_flight, other.in_flight = 20, 2
    assert policy.choose([a, b], long_prompt).reason == "balance"
    rr = RoundRobinPolicy()
    assert [rr.choose([a, b], []).instance.url for _ in range(3)] == ["a", "b", "a"]
    assert prompt_key("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) == "user\x00hi\x01"
    assert len(chunk_hashes("x" * 100)) == 3


def test_adapters_and_salts_are_routed_as_their_own_prefixes():
    """A LoRA adapter's or a cache_salt's blocks are keyed apart on the instance, so the same
    prompt under another namespace matches nothing recorded under the first."""
    a, b = Instance("a"), Instance("b")
    policy = CacheAwarePolicy(cache_threshold=0.5)
    prompt = list(range(3, 3 + 160))
    base = {"prompt": prompt}
    first = policy.choose([a, b], prompt, prompt_namespace(base))
    assert first.reason == "load" and policy.choose([a, b], prompt, prompt_namespace(base)).reason == "cache"
    for body in ({"prompt": prompt, "model": "sql-adapter"}, {"prompt": prompt, "cache_salt": "tenant-7"}):
        assert prompt_namespace(body) != prompt_namespace(base)
        assert policy.choose([a, b], prompt, prompt_namespace(body)).reason == "load"
    assert chunk_hashes(prompt, "x") != chunk_hashes(prompt) and chunk_hashes(prompt, "") == chunk_hashes(prompt)


def test_embedding_requests_are_keyed_by_their_input():
    assert prompt_key("/v1/embeddings", {"input": "some text"}) == "some text"
    assert prompt_key("/v1/embeddings", {"input": [[5, 6], [7]]}) == [5, 6]
    assert prompt_key("/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]}) == "user\x00hi\x01"
