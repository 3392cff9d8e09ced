"""`kvflow bench roofline`: the model's cost from its shapes, the fractions by hand, and the command."""

from __future__ import annotations

import json

import pytest
import torch

from kvflow.bench import roofline as rl
from kvflow.bench.hardware import matmul_gflops, median_seconds, read_bandwidth_gbps
from kvflow.config import ModelConfig
from kvflow.entrypoints.cli import main

SMOLLM2 = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      tie_word_embeddings=True)


def test_smollm2_cost_matches_the_workload_notes():
    cost = rl.model_cost(SMOLLM2, torch.bfloat16)
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    assert cost.non_embedding_matmul_params == 30 * per_layer
    assert cost.flops_per_prompt_token / 1e9 == pytest.approx(0.212, abs=1e-3)  # "about 0.21 GFLOP"
    assert cost.flops_per_output_token / 1e9 == pytest.approx(0.269, abs=1e-3)  # "0.27 GFLOP"
    assert cost.weight_bytes_per_decode_step == (30 * per_layer + 576 * 49152) * 2
    # W-offline: 9,120 prompt + 4,555 output tokens is "about 3.2 TFLOP".
    total = 9120 * cost.flops_per_prompt_token + 4555 * cost.flops_per_output_token
    assert total / 1e12 == pytest.approx(3.16, abs=0.02)


def test_fractions_by_hand():
    cost = rl.ModelCost("bfloat16", 50, 50, flops_per_prompt_token=1e8, flops_per_output_token=2e8,
                        weight_bytes_per_decode_step=10**8)
    pre = rl.prefill_fraction(cost, prompt_tokens_per_s=1000, gflops_ceiling=200)
    assert pre.achieved_gflops == pytest.approx(100) and pre.compute_fraction == pytest.approx(0.5)
    assert pre.roofline_tokens_per_s == pytest.approx(2000)
    # Batch 1 at 50 GB/s: a step streams 0.1 GB -> 2 ms -> 500 tok/s attainable (compute would allow 1000).
    dec = rl.decode_fraction(cost, tokens_per_s=100, gflops_ceiling=200, read_gbps=50, batch_size=1)
    assert dec.bound == "memory" and dec.roofline_tokens_per_s == pytest.approx(500)
    assert dec.roofline_fraction == pytest.approx(0.2) and dec.bandwidth_fraction == pytest.approx(10 / 50)
    # Batch 8: memory allows 8 / 2 ms = 4000 tok/s, compute 1000 tok/s: compute binds.
    big = rl.decode_fraction(cost, tokens_per_s=800, gflops_ceiling=200, read_gbps=50, batch_size=8)
    assert big.bound == "compute" and big.roofline_tokens_per_s == pytest.approx(1000)
    whole = rl.run_fraction(cost, prompt_tokens=100, output_tokens=50, wall_s=1.0, gflops_ceiling=200)
    assert whole.achieved_gflops == pytest.approx((100 * 1e8 + 50 * 2e8) / 1e9)  # 20 GFLOP/s
    assert whole.roofline_fraction == pytest.approx(0.1)


def test_run_floor_by_hand():
    """One compute-bound prefill step and two memory-bound decode steps, each against its own ceiling."""
    cost = rl.ModelCost("bfloat16", 50, 50, flops_per_prompt_token=1e8, flops_per_output_token=2e8,
                        weight_bytes_per_decode_step=10**8, attention_flops_per_pair=1e4, kv_bytes_per_token=1e4)
    # [tokens, logits_rows, attention_pairs, kv_tokens_read]
    prefill = [1000, 1, 500_500, 1000]  # 1e11 + 1e8 matmul + 5.005e9 attention FLOPs: 0.5255 s at 200 GFLOP/s
    decode = [4, 4, 4000, 4000]  # 4e8 + 4e8 + 4e7 FLOPs: 4.2 ms; 1e8 + 4e7 bytes at 50 GB/s: 2.8 ms -> compute
    small = [1, 1, 3000, 3000]  # 2.3e8 FLOPs: 1.15 ms; 1.3e8 bytes: 2.6 ms -> memory
    floor = rl.run_floor(cost, [prefill, decode, small], gflops_ceiling=200, read_gbps=50)
    assert floor.steps == 3 and floor.memory_bound_steps == 1
    assert floor.memory_bound_s == pytest.approx(1.3e8 / 50e9)
    assert floor.floor_s == pytest.approx((1e11 + 1e8 + 5.005e9) / 200e9 + 8.4e8 / 200e9 + 1.3e8 / 50e9)
    matmul = 1e11 + 1e8 + 8e8 + 2e8
    assert floor.best_compute_fraction == pytest.approx(matmul / floor.floor_s / 200e9)
    whole = rl.run_fraction(cost, prompt_tokens=1000, output_tokens=6, wall_s=1.0, gflops_ceiling=200,
                            steps=[prefill, decode, small], read_gbps=50)
    assert whole.floor == floor and whole.floor_fraction == pytest.approx(floor.floor_s)
    assert rl.run_fraction(cost, 1000, 6, 1.0, 200).floor is None  # no steps, no floor


def test_ceiling_measurements_are_sane():
    assert median_seconds(lambda: None, reps=3) >= 0
    assert matmul_gflops(64, torch.float32, reps=2) > 0
    assert read_bandwidth_gbps(4, reps=2) > 0


def test_roofline_command(tiny_models, tmp_path, capsys):
    path, _ = tiny_models("llama")
    latency = tmp_path / "lat.json"
    # A result's dtype is its numerics label: the compute dtype comes first (results.numerics_label).
    latency.write_text(json.dumps({"kind": "latency", "result": {"dtype": "float32, weights gguf (Q4_1, as shipped)",
                                                                  "input_len": 128,
                                                                  "ttft": {"p50": 0.01}, "itl": {"p50": 0.002}}}))
    throughput = tmp_path / "tp.json"
    steps = [[90, 3, 1400, 90]] + [[3, 3, 300, 100]] * 9
    runs = {"result": {"engine": "kvflow", "dtype": "float32", "prompt_tokens": 90, "output_tokens": 30, "wall_s": 2.0,
                       "steps": steps},
            "baseline": {"engine": "hf-transformers", "dtype": "float32", "prompt_tokens": 90, "output_tokens": 30,
                         "wall_s": 4.0}}
    throughput.write_text(json.dumps({"kind": "throughput", **runs}))
    out = tmp_path / "roof.json"
    args = ["bench", "roofline", "--model", path, "--result", str(latency), "--result", str(throughput),
            "--decode-tokens-per-s", "50",
            "--decode-batch-size", "4", "--matmul-size", "64", "--bandwidth-mib", "4", "--reps", "2",
            "--num-threads", "1", "--output", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "of the compute ceiling" in printed and "memory bandwidth" in printed
    report = json.loads(out.read_text())
    assert set(report["ceilings"]["matmul_gflops"]) == {"float32", "bfloat16"}
    phases = [f["phase"] for f in report["fractions"]]
    assert phases == ["prefill", "decode (batch 1)", "whole run (kvflow)", "whole run (hf-transformers)",
                      "decode (batch 4)"]
    assert report["fractions"][0]["tokens_per_s"] == pytest.approx(128 / 0.01)
    kv, hf = report["fractions"][2], report["fractions"][3]
    assert kv["tokens_per_s"] == pytest.approx(60.0)
    assert kv["compute_fraction"] == pytest.approx(2 * hf["compute_fraction"])  # same work in half the time
    assert report["model_cost"]["dtype"] == "float32"
    # kvflow's run carried its steps: a floor, printed; the baseline's did not.
    assert kv["floor"]["steps"] == 10 and 0 < kv["floor_fraction"] and hf["floor"] is None
    assert "step floor:" in printed and "of the compute ceiling" in printed


def test_no_floor_for_quantized_weights_or_kv():
    """The floor counts bytes in the compute dtype: a quantized run reads fewer, so it gets none."""
    steps = [[4, 4, 40, 40]]
    for dtype in ("bfloat16, weights int8", "bfloat16, KV int8"):
        assert rl._unquantized_steps({"dtype": dtype, "steps": steps}) == []
    assert rl._unquantized_steps({"dtype": "bfloat16", "steps": steps}) == steps


def test_a_run_above_the_measured_ceiling_warns_instead_of_a_share_above_100_percent():
    """A busy machine measures too low a ceiling; the run then 'beats' it, which must not print as 150 %."""
    from types import SimpleNamespace

    cost = rl.ModelCost("bfloat16", 50, 50, flops_per_prompt_token=1e8, flops_per_output_token=2e8,
                        weight_bytes_per_decode_step=10**8)
    ceilings = SimpleNamespace(matmul_gflops={"bfloat16": 200.0}, num_threads=2, matmul_size=64, reps=2,
                               read_gbps=50.0, bandwidth_mib=4)
    fine = rl.prefill_fraction(cost, prompt_tokens_per_s=1000, gflops_ceiling=200)  # 50 %
    over = rl.decode_fraction(cost, tokens_per_s=750, gflops_ceiling=200, read_gbps=50, batch_size=1)  # 1.5x roofline
    assert rl.ceiling_warnings([fine]) == []
    warnings = rl.ceiling_warnings([fine, over])
    assert len(warnings) == 1 and "decode (batch 1)" in warnings[0] and "busier" in warnings[0]
    assert "roofline 1.50x" in warnings[0] and "memory bandwidth 1.50x" in warnings[0]
    text = rl.describe(cost, ceilings, [fine, over])
    assert "50.0% of the compute ceiling" in text
    assert "150.0%" not in text and "above the measured ceiling" in text and warnings[0] in text
