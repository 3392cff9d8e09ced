"""`kvflow bench embed` end to end on a tiny random model, through the real command line: both
engines' vectors agree, pooled the way --pooler-config says, and a seen prompt is never timed."""

from __future__ import annotations

import json

import pytest

from kvflow.bench.embed import embed_prompts
from kvflow.entrypoints.cli import main

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--num-threads", "1"]
SMALL = ["--num-prompts", "6", "--min-len", "4", "--max-len", "40", "--baseline", "hf", "--baseline-batch-size", "4"]


@pytest.mark.parametrize("pooler", [None, '{"pooling_type": "MEAN", "normalize": false}'])
def test_bench_embed_agrees_with_transformers(tiny_models, tmp_path, pooler):
    path, _ = tiny_models("llama")
    out = tmp_path / "embed.json"
    extra = ["--pooler-config", pooler] if pooler else []
    assert main(["bench", "embed", "--model", path, *ENGINE, *SMALL, *extra, "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["agreement"]["min_cosine"] > 0.9999
    kv, hf = report["results"]["kvflow"], report["results"]["hf"]
    assert kv["num_prompts"] == hf["num_prompts"] == 6 and kv["prompt_tokens"] == hf["prompt_tokens"]
    assert report["kvflow_over_hf"] == pytest.approx(hf["wall_s"] / kv["wall_s"])


def test_draws_are_reproducible_and_distinct():
    a, b = embed_prompts(8, 16, 256, 4, (1000, 40000)), embed_prompts(8, 16, 256, 104, (1000, 40000))
    assert a == embed_prompts(8, 16, 256, 4, (1000, 40000))
    assert all(16 <= len(p) <= 256 for p in a) and not {tuple(p) for p in a} & {tuple(p) for p in b}
