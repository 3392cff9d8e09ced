"""Layouts are checked before anything starts, and a refusal names the setting and the numbers."""

from __future__ import annotations

import pytest

from kvflow.config import EngineConfig, ModelConfig
from kvflow.distributed.config import ParallelConfig

CFG = ModelConfig("LlamaForCausalLM", vocab_size=317, hidden_size=64, intermediate_size=160, num_hidden_layers=5,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=8)


def test_bad_values_are_refused_with_the_setting_named():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend: 'threads'"):
        EngineConfig(distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="'uni' runs one process.*4 ranks"):
        EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="uni")
    assert ParallelConfig(2).backend == "mp" and ParallelConfig().backend == "uni"


def test_shapes_that_do_not_split():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 8 attention heads"):
        ParallelConfig(3).check_model(CFG)
    with pytest.raises(ValueError, match="pipeline_parallel_size=6 exceeds the model's 5 layers"):
        ParallelConfig(1, 6).check_model(CFG)
    import dataclasses

    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads and is not a multiple"):
        ParallelConfig(4).check_model(dataclasses.replace(CFG, num_attention_heads=12, num_key_value_heads=3))
    ParallelConfig(8).check_model(CFG)  # 8 > 2 KV heads: each replicated on 4 ranks


def test_rank_shares():
    par = ParallelConfig(4, 2)
    assert [par.layer_range(5, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert par.vocab_shard(317, 3) == (240, 77, 80)
    assert [par.kv_heads(CFG, t) for t in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    local = par.rank_model_config(CFG, 5)  # tp rank 1 of stage 1
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.vocab_size,
            local.num_hidden_layers) == (2, 1, 40, 80, 2)
    assert par.output_rank == 4


@pytest.mark.parametrize("command", [["serve"], ["bench", "throughput"], ["generate", "hi"]])
def test_cli_flags_reach_the_engine_config(command):
    from kvflow.entrypoints.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(command + ["-tp", "2", "--pipeline-parallel-size", "3",
                                                "--distributed-executor-backend", "mp"])
    config = engine_config_from_args(args)
    assert (config.tensor_parallel_size, config.pipeline_parallel_size,
            config.distributed_executor_backend) == (2, 3, "mp")


def test_more_ranks_than_usable_cores_are_refused(monkeypatch):
    """The cores counted are the affinity mask's (`taskset`), not the machine's."""
    from kvflow.distributed import launch

    monkeypatch.delenv("KVFLOW_OVERSUBSCRIBE", raising=False)
    monkeypatch.setattr(launch, "usable_cpus", lambda: 1)
    with pytest.raises(ValueError, match=r"= 2 ranks, but this process may use 1 CPU cores .*KVFLOW_OVERSUBSCRIBE=1"):
        launch.check_servable(ParallelConfig(2), EngineConfig(), CFG, None)
    monkeypatch.setenv("KVFLOW_OVERSUBSCRIBE", "1")
    launch.check_servable(ParallelConfig(2), EngineConfig(), CFG, None)
