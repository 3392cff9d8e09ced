"""`kvflow bench speculative` end to end through the command line, on a tiny model."""

from __future__ import annotations

import argparse
import json

import pytest

from kvflow.bench.speculative import build_requests, warmup_requests
from kvflow.entrypoints.cli import main

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "1024", "--num-threads", "1"]
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": null}'


@pytest.mark.parametrize("concurrency", ["1", "0"])
def test_bench_speculative_random(tiny_models, tmp_path, capsys, concurrency):
    path, _ = tiny_models("llama")
    out = tmp_path / "spec.json"
    argv = ["bench", "speculative", "--model", path, *ENGINE, "--speculative-config", NGRAM, "--dataset", "random",
            "--num-prompts", "3", "--output-len", "24", "--ignore-eos", "--max-concurrency", concurrency,
            "--num-warmup", "1", "--output", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())["result"]
    assert res["identical_outputs"] is True
    assert res["plain"]["output_tokens"] == res["speculative"]["output_tokens"] == 3 * 24
    assert res["num_draft_tokens"] >= res["num_accepted_tokens"] and res["num_spec_steps"] > 0
    assert res["speedup"] == pytest.approx(res["speculative"]["output_tokens_per_s"] / res["plain"]["output_tokens_per_s"])
    assert "speed-up x" in capsys.readouterr().out


def test_bench_speculative_needs_a_config(tiny_models, capsys):
    path, _ = tiny_models("llama")
    assert main(["bench", "speculative", "--model", path, *ENGINE, "--dataset", "random"]) == 2
    assert "--speculative-config" in capsys.readouterr().err


def test_bad_speculative_config_on_the_command_line(tiny_models, capsys):
    path, _ = tiny_models("llama")
    assert main(["bench", "speculative", "--model", path, *ENGINE, "--speculative-config", '{"method": "eagle"}']) == 2
    assert "speculative_config.method" in capsys.readouterr().err


def test_jsonl_warmup_shares_no_prompt_with_the_timed_set(tmp_path):
    # A JSONL file has one draw: warming up on its first rows would leave the timed prompts in
    # the prefix cache, and the timed run would skip their prefill.
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5, 6, 7, 8], "output_len": 4}) + "\n"
                    + json.dumps({"prompt_token_ids": [9, 10, 11]}) + "\n")
    args = argparse.Namespace(dataset="jsonl", dataset_path=str(path), output_len=None, num_warmup=2, warmup_seed=100)
    timed = build_requests(args, None, 32000, seed=0, count=2)
    warmup = warmup_requests(args, None, 32000, timed)
    assert [(len(r.prompt_token_ids), r.output_len) for r in warmup] == [(4, 4), (3, 128)]
    assert not {tuple(r.prompt_token_ids) for r in warmup} & {tuple(r.prompt_token_ids) for r in timed}
