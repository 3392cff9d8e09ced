"""`kvflow plan -tp T -pp P --device-memory 80GiB`: each rank's share, from the config alone."""

from __future__ import annotations

import json
import re

import pytest

from kvflow.config import ModelConfig
from kvflow.distributed.config import ParallelConfig
from kvflow.distributed.plan import plan_ranks, rank_num_parameters
from kvflow.entrypoints.cli import main

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
             "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 128256,
             "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.fixture
def llama_70b(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    return str(path)


def test_70b_on_8_devices_of_80gib(llama_70b, capsys):
    assert main(["plan", "--model", llama_70b, "-tp", "8", "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d+\s", line)]
    assert len(rows) == 8
    for rank, row in enumerate(rows):
        # 80 layers x K,V x one of the 8 KV heads x 128 dims x 2 bytes = 40,960 B per token per rank
        assert row[:4] == [str(rank), str(rank), "0", "0-79"] and row[6] == "40,960"
    # weights: 1/8 of 70.55 B parameters in bf16, 16.43 GiB; (0.9 x 80 GiB - that) / (40,960 x 16)
    assert rows[0][4:6] == ["16.43", "GiB"] and rows[0][7] == "91,047"
    assert "every rank's pool has 91,047 blocks" in out


def test_pipeline_stages_hold_their_layers_and_ends():
    cfg = ModelConfig.from_hf_config(LLAMA_70B)
    par = ParallelConfig(2, 3)
    total = sum(rank_num_parameters(cfg, par, r) for r in range(par.world_size))
    # every parameter on exactly one rank (the vocabulary splits evenly), but the norms, which each
    # of a stage's 2 tensor-parallel ranks holds whole
    norms = cfg.num_hidden_layers * 2 * cfg.hidden_size + cfg.hidden_size
    assert total == cfg.num_parameters() + norms
    plans = plan_ranks(cfg, par, __import__("torch").bfloat16, 16, 8192, device_memory=80 << 30)
    first, last = plans[0], plans[-1]
    assert first.bytes_per_token == 27 * 2 * 4 * 128 * 2 and last.bytes_per_token == 26 * 2 * 4 * 128 * 2
    assert first.weight_bytes > plans[2].weight_bytes  # 27 layers and the embedding against 27 layers


def test_plan_refuses_a_split_that_does_not_divide(llama_70b, capsys):
    assert main(["plan", "--model", llama_70b, "-tp", "3", "--device-memory", "80GiB"]) == 2
    assert "tensor_parallel_size=3 does not divide the model's 64 attention heads" in capsys.readouterr().err
