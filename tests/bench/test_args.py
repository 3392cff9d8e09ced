"""`kvflow bench` options are checked before any model loads: one line naming the option, exit
status 2, no traceback (kvflow/bench/args.py and each bench's check_arguments)."""

from __future__ import annotations

import re

import pytest

from kvflow.entrypoints.cli import main

MISSING = "/nonexistent-kvflow-dir/x"


@pytest.mark.parametrize(("argv", "message"), [
    (["throughput", "--num-prompts", "0"], "--num-prompts must be at least 1, got 0"),
    (["throughput", "--repeat", "0"], "--repeat must be at least 1, got 0"),
    (["throughput", "--input-len-min", "10", "--input-len-max", "5"],
     r"--input-len-min \(10\) must not exceed --input-len-max \(5\)"),
    (["throughput", "--dataset", "jsonl"], "--dataset jsonl needs --dataset-path"),
    (["throughput", "--dataset", "jsonl", "--dataset-path", MISSING], f"--dataset-path: no such file: {MISSING}"),
    (["throughput", "--output", MISSING + "/r.json"], f"--output: no such directory: {MISSING}"),
    (["latency", "--num-iters-warmup", "-2"], "--num-iters-warmup must be at least 0, got -2"),
    (["latency", "--output-len", "0"], "--output-len must be at least 1, got 0"),
    (["prefix", "--num-prompts", "0"], "--num-prompts must be at least 1, got 0"),
    (["prefix", "--no-enable-prefix-caching"], "leave out --no-enable-prefix-caching"),
    (["speculative", "--num-warmup", "-1"], "--num-warmup must be at least 0, got -1"),
    (["quality", "--text", MISSING], f"--text: no such file: {MISSING}"),
    (["embed", "--save-vectors", MISSING + "/v.npy"], f"--save-vectors: no such directory: {MISSING}"),
    (["roofline", "--result", MISSING], f"--result: no such file: {MISSING}"),
])
def test_a_bad_option_fails_before_the_model_loads(argv, message, capsys, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the options were checked")

    monkeypatch.setattr("kvflow.engine.llm_engine.LLMEngine.__init__", no_engine)
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvflow bench: error: ") and "Traceback" not in err
    assert re.search(message, err), err


def test_quality_checks_every_mode_before_scoring_one(capsys, monkeypatch):
    monkeypatch.setattr("kvflow.bench.quality.score", lambda *a: pytest.fail("a mode was scored"))
    monkeypatch.setattr("kvflow.LLM.__init__", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["bench", "quality", "--modes", "none,bogus"]) == 2
    assert "quantization: 'bogus' is not supported" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    path, _ = tiny_models("llama")
    return path


def test_latency_refuses_an_output_the_context_would_cut(tiny, capsys):
    """16 prompt + 8 output tokens do not fit a 20-token context: the ITL would count only 4."""
    argv = ["bench", "latency", "--model", tiny, "--dtype", "float32", "--max-model-len", "20", "--input-len", "16",
            "--output-len", "8", "--num-iters", "1", "--num-iters-warmup", "0"]
    assert main(argv) == 2
    assert "take 24 tokens, more than max_model_len 20" in capsys.readouterr().err


def test_a_file_error_while_running_is_one_line(monkeypatch, capsys):
    def unreadable(args):
        raise PermissionError(13, "Permission denied", "/root/secret.json")

    monkeypatch.setattr("kvflow.bench.roofline.run", unreadable)
    assert main(["bench", "roofline"]) == 1
    err = capsys.readouterr().err
    assert err == "kvflow bench: error: [Errno 13] Permission denied: '/root/secret.json'\n"
