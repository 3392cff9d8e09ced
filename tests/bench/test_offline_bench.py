"""`kvflow bench throughput` (with and without the transformers baseline) and `bench latency`, end to end
on a tiny random model, through the real command line."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
import torch

from kvflow.bench import hf_baseline
from kvflow.bench.datasets import BenchRequest, fit_token_range
from kvflow.bench.latency import prompts
from kvflow.bench.machine import machine_info
from kvflow.entrypoints.cli import main

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--num-threads", "1"]
SMALL = ["--num-prompts", "5", "--input-len-min", "4", "--input-len-max", "24", "--output-len-min", "2",
         "--output-len-max", "12", "--no-progress"]


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    path, _ = tiny_models("llama")
    return path


def _load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_quantized_run_says_its_weights(tiny, tmp_path):
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", tiny, *ENGINE, "-q", "int4", *SMALL, "--output", str(out)]) == 0
    assert _load(out)["result"]["dtype"] == "float32, weights int4 (groups of 32)"


def test_int8_kv_run_says_its_kv_dtype(tiny, tmp_path):
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", tiny, *ENGINE, "--kv-cache-dtype", "int8", *SMALL,
                 "--output", str(out)]) == 0
    assert _load(out)["result"]["dtype"] == "float32, KV int8"


def test_throughput_alone(tiny, tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", tiny, *ENGINE, *SMALL, "--output", str(out)]) == 0
    report = _load(out)
    res = report["result"]
    assert report["kind"] == "throughput" and "baseline" not in report
    assert res["engine"] == "kvflow" and res["dtype"] == "float32" and res["num_requests"] == 5
    assert res["total_tokens_per_s"] == pytest.approx((res["prompt_tokens"] + res["output_tokens"]) / res["wall_s"])
    # The warm-up draw differs, so nothing was served from the prefix cache: every prompt token was computed.
    assert res["computed_tokens"] == res["prompt_tokens"] + res["output_tokens"] - res["num_requests"]
    # Each step's shape, for bench roofline's floor: the timed run's steps only, not the warm-up's.
    assert sum(step[0] for step in res["steps"]) == res["computed_tokens"]
    assert sum(step[1] for step in res["steps"]) == res["output_tokens"]
    printed = capsys.readouterr().out
    assert "kvflow (float32)" in printed
    # The machine beside the figure: CPU family and which kernels ran (bench/machine.py).
    assert report["machine"] == asdict(machine_info()) and "  machine: " in printed


def test_throughput_repeat_reports_each_run(tiny, tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", tiny, *ENGINE, *SMALL, "--repeat", "3", "--output", str(out)]) == 0
    runs = _load(out)["repeats"]
    assert len(runs) == 3 and all(r["total_tokens_per_s"] > 0 and r["rss_mb"] > 0 for r in runs)
    assert "3 runs: median" in capsys.readouterr().out


def test_throughput_with_hf_baseline(tiny, tmp_path, capsys):
    out = tmp_path / "tp-hf.json"
    args = ["bench", "throughput", "--model", tiny, *ENGINE, *SMALL, "--baseline", "hf", "--baseline-batch-size", "2",
            "--output", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    report = _load(out)
    ours, base, setup, ratios = report["result"], report["baseline"], report["baseline_setup"], report["ratios"]
    assert base["engine"] == "hf-transformers" and base["dtype"] == ours["dtype"] == "float32"
    assert (base["prompt_tokens"], base["output_tokens"]) == (ours["prompt_tokens"], ours["output_tokens"])
    assert setup["batch_size"] == 2 and setup["padding"] == "left" and setup["num_threads"] == 1
    assert ratios["total_tokens_per_s"] == pytest.approx(ours["total_tokens_per_s"] / base["total_tokens_per_s"])
    assert ratios["wall_s"] == pytest.approx(ours["wall_s"] / base["wall_s"])
    # Padding and the longer outputs of each static batch are work the baseline really did.
    assert base["computed_tokens"] >= base["prompt_tokens"] + base["output_tokens"] - base["num_requests"]
    assert "kvflow / hf (same run): total tok/s x" in printed
    assert "static batches of 2" in printed and "left padding" in printed and "1 torch threads" in printed


def test_hf_baseline_generates_the_same_greedy_tokens_as_kvflow(tiny):
    """The baseline must be a real run of the same requests: its greedy tokens match kvflow's (fp32)."""
    from kvflow import LLM
    from kvflow.sampling.params import SamplingParams

    reqs = [BenchRequest([5, 17, 200, 33], 6), BenchRequest([9, 8, 7, 6, 5, 4, 3, 2], 4)]
    model = hf_baseline.load_hf_model(tiny, torch.float32)
    ids, mask = hf_baseline.pad_left([r.prompt_token_ids for r in reqs], 0)
    assert mask.tolist()[0] == [0] * 4 + [1] * 4 and ids.tolist()[0][:4] == [0] * 4
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory=16 << 20, max_model_len=256)
    for row, req in enumerate(reqs):
        ours = llm.generate({"prompt_token_ids": req.prompt_token_ids},
                            SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=True), use_tqdm=False)
        assert out[row, ids.shape[1]:ids.shape[1] + req.output_len].tolist() == ours[0].outputs[0].token_ids


def test_hf_baseline_needs_accelerate_for_gguf(monkeypatch):
    monkeypatch.setattr(hf_baseline.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install accelerate"):
        hf_baseline.require_accelerate()


def test_static_batches_keep_request_order():
    reqs = [BenchRequest([i], 1) for i in range(5)]
    assert [[r.prompt_token_ids[0] for r in b] for b in hf_baseline.static_batches(reqs, 2)] == [[0, 1], [2, 3], [4]]


def test_token_range_fits_small_vocabularies_only():
    assert fit_token_range((1000, 40000), 49152) == (1000, 40000)  # the published workloads stay exact
    assert fit_token_range((1000, 40000), 320) == (160, 320)


def test_latency_first_prompt_is_w_latency():
    first, second = prompts(1, 2, 128, (1000, 40000))
    assert first == np.random.default_rng(1).integers(1000, 40000, size=128).tolist()
    assert first != second  # every iteration gets its own prompt


def test_latency_end_to_end(tiny, tmp_path, capsys):
    out = tmp_path / "lat.json"
    args = ["bench", "latency", "--model", tiny, *ENGINE, "--input-len", "16", "--output-len", "8", "--num-iters", "3",
            "--output", str(out)]
    assert main(args) == 0
    res = _load(out)["result"]
    assert len(res["iterations"]) == 3
    for it in res["iterations"]:
        assert it["output_tokens"] == 8 and it["cached_prompt_tokens"] == 0
        assert 0 < it["ttft_s"] < it["e2e_s"] and it["mean_itl_s"] > 0
    assert res["ttft"]["count"] == 3 and res["ttft"]["p50"] > 0 and res["itl"]["p90"] >= res["itl"]["p50"]
    assert 0 < res["rss_mb"] <= res["peak_rss_mb"]
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "mean ITL" in printed and "WARNING" not in printed


def test_latency_refuses_warmup_on_the_timed_draw(tiny):
    args = ["bench", "latency", "--model", tiny, *ENGINE, "--warmup-seed", "1", "--dataset-seed", "1"]
    assert main(args) == 2


def test_prefix_bench_compares_caching_off_and_on(tiny, tmp_path, capsys):
    """Sharing within the workload cuts the computed tokens by the shared part, outputs aside."""
    out = tmp_path / "prefix.json"
    args = ["bench", "prefix", "--model", tiny, *ENGINE, "--num-prompts", "6", "--prefix-len", "64",
            "--suffix-len", "8", "--output-len", "4", "--max-num-batched-tokens", "80", "--output", str(out)]
    assert main(args) == 0
    report = _load(out)
    off, on = report["results"]["prefix caching off"], report["results"]["prefix caching on"]
    assert off["computed_tokens"] == 6 * (64 + 8 + 3)
    # An 80-token budget: step 1 computes prompt 0 (72 tokens) and starts prompt 1 on the 8 left,
    # before anything is cached; prompts 2-5 then reuse the 64-token prefix (4 full blocks).
    assert on["computed_tokens"] == off["computed_tokens"] - 4 * 64
    assert report["prefill_tokens"] == {"prefix caching off": 6 * 72, "prefix caching on": 6 * 72 - 4 * 64}
    assert report["ratios"]["computed_tokens_off_over_on"] == pytest.approx(off["computed_tokens"] / on["computed_tokens"])
    assert "prefix caching cuts prefill work" in capsys.readouterr().out
