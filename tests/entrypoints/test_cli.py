"""The `kvflow` command line: plan (no weights), generate (console script) and chat."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.entrypoints import cli, cli_args, cli_chat

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
SMALL_ENGINE = ["--kv-cache-memory", "64MiB", "--max-model-len", "512", "--dtype", "float32"]


@pytest.fixture
def llama3_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return path


def kvflow_command() -> list[str]:
    script = Path(sys.executable).parent / "kvflow"
    if script.exists():
        return [str(script)]
    found = shutil.which("kvflow")
    return [found] if found else [sys.executable, "-m", "kvflow.entrypoints.cli"]


@pytest.mark.parametrize("as_dir", [False, True])
def test_plan_llama3_8b_without_weights(llama3_config, capsys, as_dir):
    model = str(llama3_config.parent if as_dir else llama3_config)
    assert cli.main(["plan", "--model", model, "--kv-cache-memory", "4GiB"]) == 0
    out = capsys.readouterr().out
    # 32 layers x (K, V) x 8 kv heads x 128 head dim x 2 bytes (bf16)
    assert "131,072 B" in out
    # 4 GiB / (131072 B x 16 tokens per block)
    assert f"{(4 << 30) // (131072 * 16):,} blocks" in out and "2,048 blocks" in out
    assert "8,192 tokens" in out and "bfloat16" in out


QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json, the keys kvflow reads
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48, "head_dim": 128,
    "num_attention_heads": 32, "num_key_value_heads": 4, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_plan_a_mixture_of_experts_without_weights(tmp_path, capsys):
    """Qwen3-30B-A3B: every expert's weights are held (30.5 B), a token reads its top 8 (3.0 B
    with the LM head; the model card's 3.3 B "activated" also counts the embedding table)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    assert cli.main(["plan", "--model", str(tmp_path), "--kv-cache-memory", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "30.53 B parameters; 128 experts, top 8, in 48 of 48 layers: a token reads 3.03 B" in out
    assert "98,304 B" in out  # 48 layers x (K, V) x 4 KV heads x 128 x 2 bytes


def test_plan_options_and_errors(llama3_config, capsys):
    assert cli.main(["plan", "--model", str(llama3_config), "--dtype", "float32", "--block-size", "32",
                     "--max-model-len", "4096", "--kv-cache-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "262,144 B" in out and "128 blocks" in out and "4,096 tokens" in out
    # too little memory for one sequence: a one-line error, exit status 2, no traceback
    assert cli.main(["plan", "--model", str(llama3_config), "--kv-cache-memory", "1MiB"]) == 2
    assert "kv_cache_memory" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--block-size", "0"], "block_size must be a positive integer, got 0"),
    (["--block-size", "-5"], "block_size must be a positive integer, got -5"),
    (["--max-model-len", "0", "-pp", "2"], "max_model_len must be a positive integer, got 0"),
    (["-tp", "0"], "tensor_parallel_size must be a positive integer, got 0"),
    (["--memory-utilization", "3"], r"memory_utilization must be a fraction in \(0, 1\], got 3.0"),
    # what `serve` refuses on any machine: a split the heads do not allow, quantized weights split by T
    (["-tp", "3"], "tensor_parallel_size=3 does not divide the model's 32 attention heads"),
    (["-tp", "2", "--quantization", "int8"], "quantization=int8: tensor_parallel_size=2 splits float weights only"),
    # a group size some layer cannot split, as loading refuses it
    (["--quantization", "int4", "--quantization-group-size", "96", "--dtype", "bfloat16"],
     r"quantization_group_size=96: layer .*q/k/v_proj.* has 4096 inputs, which are not whole groups of 96"),
])
def test_plan_refuses_what_the_engine_refuses(llama3_config, capsys, flags, message):
    """`kvflow plan` runs the engine's option checks: no ZeroDivisionError, no negative plan."""
    assert cli.main(["plan", "--model", str(llama3_config), *flags]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


def test_parse_bytes():
    assert cli.parse_bytes("4GiB") == 4 << 30
    assert cli.parse_bytes("512MiB") == 512 << 20
    assert cli.parse_bytes("1073741824") == 1 << 30
    assert cli.parse_bytes("1.5 GB") == 1_500_000_000
    for bad in ("lots", "4XB", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.parse_bytes(bad)


def test_parser_has_subcommands_and_engine_options():
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--port", "9001", "--api-key", "k", "--max-waiting", "4",
                              "--kv-cache-memory", "512MiB", "--no-enable-prefix-caching", "--num-threads", "2"])
    config = cli.engine_config_from_args(args)
    assert args.func is cli.run_serve and args.host == "127.0.0.1" and args.port == 9001
    assert config.kv_cache_memory == 512 << 20 and config.enable_prefix_caching is False and config.num_threads == 2
    assert cli.main([]) == 2  # no subcommand: help, failure status
    pooled = cli.engine_config_from_args(parser.parse_args(["serve", "--pooler-config", '{"pooling_type": "mean"}']))
    assert (pooled.pooler_config.pooling_type, pooled.pooler_config.normalize) == ("MEAN", True)


@pytest.mark.parametrize(("flags", "message"), [
    (["--enable-auto-tool-choice"], "go together"),
    (["--tool-call-parser", "hermes"], "go together"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "qwen"], "unknown parser 'qwen'; supported: hermes"),
    (["--lora-modules", "a=/tmp"], "need --enable-lora"),
    (["--enable-lora", "--lora-modules", "a"], "is not name=path"),
    (["--enable-lora", "--lora-modules", "a=/nonexistent/adapter"], "is not a directory"),
    (["--enable-lora", "--max-loras", "0"], "max_loras must be a positive integer"),
    (["--pooler-config", '{"pooling_type": "CLS"}'], "pooling_type 'CLS' is not supported"),
    (["--max-waiting", "-5"], "--max-waiting must be >= 0, or -1 for no limit, got -5"),
])
def test_tool_call_and_lora_flags_are_checked_before_the_weights_load(flags, message):
    args = cli.build_parser().parse_args(["serve", "--model", "/nonexistent", *flags])
    with pytest.raises(ValueError, match=message):
        cli.run_serve(args)


def test_a_port_in_use_fails_before_the_weights_load():
    """Before: the model loaded, "serving on ..." was logged, then uvicorn died on EADDRINUSE."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = cli.build_parser().parse_args(["serve", "--model", "/nonexistent", "--port", str(port)])
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            cli.run_serve(args)


def test_localhost_binds_ipv4_as_uvicorn_did():
    """127.0.0.1 is where clients and the router look; getaddrinfo's first answer may be ::1."""
    from kvflow.entrypoints.openai.lifecycle import bind_socket

    with bind_socket("localhost", 0) as sock:
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "127.0.0.1"


@pytest.mark.parametrize("argv", [["--log-level", "foo", "plan"], ["serve", "--uvicorn-log-level", "foo"]])
def test_log_levels_are_choices(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2 and "invalid choice: 'foo'" in capsys.readouterr().err.replace("FOO", "foo")
    assert cli.build_parser().parse_args(["--log-level", "debug", "plan"]).log_level == "DEBUG"


def test_generate_console_script():
    cmd = kvflow_command() + ["generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
                              *SMALL_ENGINE]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), proc.stderr


def _record_conversations(monkeypatch, offline_llm) -> list[list[dict]]:
    """Every conversation `kvflow chat` hands to the chat template, in order."""
    seen: list[list[dict]] = []
    real = type(offline_llm).apply_chat_template

    def spy(self, conversation, add_generation_prompt=True):
        seen.append([dict(m) for m in conversation])
        return real(self, conversation, add_generation_prompt)

    monkeypatch.setattr(type(offline_llm), "apply_chat_template", spy)
    return seen


def test_chat_keeps_history_and_quits(monkeypatch, offline_llm):
    stdin = io.StringIO("Say hello.\n\nWhat did I ask you?\n/exit\nnever read\n")
    stdout = io.StringIO()
    args = cli.build_parser().parse_args(["chat", "--max-tokens", "6", "--temperature", "0", *SMALL_ENGINE])
    seen = _record_conversations(monkeypatch, offline_llm)
    monkeypatch.setattr(cli_chat, "_build_llm", lambda _args: offline_llm)  # weights load once per session
    assert cli_chat.run_chat(args, stdin=stdin, stdout=stdout) == 0
    assert len(seen) == 2  # the empty line is skipped, /exit stops before "never read"
    second = seen[1]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] and second[1]["content"] in stdout.getvalue()
    assert stdout.getvalue().count("> ") == 4
    assert not offline_llm.engine.has_unfinished_requests()


# ---- sampling precedence and --verbose ---------------------------------------------------------
class _StubLLM:
    """Just what with_cli_defaults reads: the engine's sampling defaults."""

    def __init__(self, values: dict) -> None:
        from types import SimpleNamespace

        from kvflow.loader.generation_config import SamplingDefaults

        self.engine = SimpleNamespace(sampling_defaults=SamplingDefaults(values, "test"))


@pytest.mark.parametrize(
    ("command", "flags", "model", "expected"),
    [
        # no flags: the model's defaults, its max_tokens over the command's own
        ("generate", [], {"temperature": 0.2, "top_p": 0.9, "max_tokens": 64}, (0.2, 0.9, 64)),
        # a flag wins over the model, even when it equals vLLM's default
        ("generate", ["--temperature", "1.0", "--max-tokens", "8"], {"temperature": 0.2, "top_p": 0.9}, (1.0, 0.9, 8)),
        # a model without defaults (or --generation-config vllm): vLLM's, and the command's max_tokens
        ("generate", [], {}, (1.0, 1.0, 256)),
        ("chat", [], {}, (1.0, 1.0, 512)),
        ("chat", ["--top-p", "0.5"], {"temperature": 0.2, "top_p": 0.9}, (0.2, 0.5, 512)),
    ],
)
def test_sampling_precedence(command, flags, model, expected):
    args = cli.build_parser().parse_args([command, *(["hi"] if command == "generate" else []), *flags])
    params = cli_args.with_cli_defaults(cli_args.sampling_params_from_args(args), args, _StubLLM(model))
    assert (params.temperature, params.top_p, params.max_tokens) == expected


def test_sampling_flags_default_to_unset_and_generation_config_reaches_the_engine():
    args = cli.build_parser().parse_args(["generate", "hi", "--generation-config", "vllm"])
    assert cli_args.sampling_params_from_args(args).explicit_fields == frozenset()
    assert cli.engine_config_from_args(args).generation_config == "vllm"
    assert cli.engine_config_from_args(cli.build_parser().parse_args(["serve"])).generation_config == "auto"


def test_generate_uses_the_model_defaults_and_verbose_prints_stats(monkeypatch, offline_llm, capsys):
    seen = []
    real = type(offline_llm).generate

    def spy(self, prompts, params=None, **kwargs):
        seen.append(params)
        return real(self, prompts, params, **kwargs)

    monkeypatch.setattr(type(offline_llm), "generate", spy)
    monkeypatch.setattr(cli_chat, "_build_llm", lambda _args: offline_llm)
    args = cli.build_parser().parse_args(["generate", "The capital of France is", "--max-tokens", "5",
                                          "--sampling-seed", "0", "--verbose"])
    assert cli_chat.run_generate(args) == 0
    assert (seen[0].temperature, seen[0].top_p, seen[0].max_tokens) == (0.2, 0.9, 5)
    captured = capsys.readouterr()
    assert captured.out.strip() and "tokens" not in captured.out  # stdout is the text alone
    stats = captured.err.strip().splitlines()[-1]
    assert "prompt: 5 tokens" in stats and "output: " in stats and "TTFT: " in stats and "tokens/s" in stats


def test_chat_reset_and_verbose(monkeypatch, offline_llm):
    stdin = io.StringIO("Say hello.\n/reset\nSay goodbye.\n/bye\n")
    stdout = io.StringIO()
    args = cli.build_parser().parse_args(["chat", "--max-tokens", "4", "--verbose", "--system", "Be brief.",
                                          *SMALL_ENGINE])
    seen = _record_conversations(monkeypatch, offline_llm)
    monkeypatch.setattr(cli_chat, "_build_llm", lambda _args: offline_llm)
    assert cli_chat.run_chat(args, stdin=stdin, stdout=stdout) == 0
    # After /reset the second question starts a new conversation (the system prompt stays).
    assert [[m["role"] for m in c] for c in seen] == [["system", "user"], ["system", "user"]]
    assert seen[1][1]["content"] == "Say goodbye."
    text = stdout.getvalue()
    assert "temperature=0.2" in text.splitlines()[0]  # the defaults in use, shown up front
    assert text.count("TTFT: ") == 2 and text.count("output: ") == 2
    assert "(new conversation)" in text
