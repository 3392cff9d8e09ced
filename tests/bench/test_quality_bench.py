"""`kvflow bench quality`: perplexity and agreement per quantization mode, from the CLI."""

from __future__ import annotations

import json
import math

import pytest

from kvflow.bench.quality import DEFAULT_TEXT, parse_mode, windows
from kvflow.entrypoints.cli import main


def test_modes_and_windows():
    assert parse_mode("int4-g128") == ("int4", 128, "auto") and parse_mode("gguf") == ("gguf", None, "auto")
    assert parse_mode("kv-int8") == ("none", None, "int8") and parse_mode("int4-g64+kv-int8") == ("int4", 64, "int8")
    with pytest.raises(ValueError, match="-g<inputs>"):
        parse_mode("int4-gx")
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4)[-1] == [4, 5, 6, 7]  # a last window of one token scores nothing
    assert "Alice was beginning to get very tired" in DEFAULT_TEXT.read_text()


def test_quality_of_modes_on_the_default_model(smollm2_gguf, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(DEFAULT_TEXT.read_text()[:1500])
    out = tmp_path / "quality.json"
    assert main(["bench", "quality", "--dtype", "float32", "--modes", "none,gguf,int8,kv-int8", "--text", str(text),
                 "--window", "128", "--json", str(out), "--kv-cache-memory", str(64 << 20),
                 "--max-model-len", "256"]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    base, shipped, int8 = rows["none"], rows["gguf"], rows["int8"]
    assert base["top1_agreement"] == 1.0 and base["num_scored"] > 300
    assert 1.0 < base["perplexity"] < 100 and math.isfinite(base["perplexity"])
    # The file's own blocks are the dequantized weights: equal up to summation order.
    assert shipped["perplexity"] == pytest.approx(base["perplexity"], rel=1e-4)
    assert shipped["top1_agreement"] > 0.99
    # int8 on top of the 4-bit weights: close, and the plan counts fewer bytes than fp32.
    assert int8["perplexity"] == pytest.approx(base["perplexity"], rel=0.05)
    assert int8["weight_bytes"] < base["weight_bytes"] / 2
    # The int8 KV cache over float weights: within 1 % (the target), most top-1 kept.
    kv = rows["kv-int8"]
    assert kv["kv_cache_dtype"] == "int8" and base["kv_cache_dtype"] == "float32"
    assert kv["perplexity"] == pytest.approx(base["perplexity"], rel=0.01) and kv["top1_agreement"] > 0.95
    assert "ppl" in capsys.readouterr().out
