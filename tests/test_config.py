"""EngineConfig refuses a wrong option at construction, naming it (LLM(...), kvflow serve/plan)."""

import numpy as np
import pytest

from kvflow.config import EngineConfig, parse_size


@pytest.mark.parametrize(("options", "message"), [
    ({"max_model_len": 2.5}, r"max_model_len must be a positive integer, got 2.5"),
    ({"max_model_len": "abc"}, r"max_model_len must be a positive integer, got 'abc'"),
    ({"max_num_seqs": True}, r"max_num_seqs must be a positive integer, got True"),
    ({"block_size": 0}, r"block_size must be a positive integer, got 0"),
    ({"num_threads": -3}, r"num_threads must be a positive integer, or 0 for every usable CPU, got -3"),
    ({"num_threads": 1.5}, r"num_threads must be a positive integer, or 0"),
    ({"seed": "abc"}, r"seed must be an integer in \[-9223372036854775808, 18446744073709551615\], got 'abc'"),
    ({"seed": 2**70}, r"seed must be an integer in \[.*\], got 1180591620717411303424"),
    ({"enable_prefix_caching": "no"}, r"enable_prefix_caching must be True or False, got 'no'"),
    ({"quantize_lm_head": 1}, r"quantize_lm_head must be True or False, got 1"),
    ({"memory_utilization": 2.0}, r"memory_utilization must be a fraction in \(0, 1\], got 2.0"),
    ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be a fraction in \(0, 1\], got 0"),
    ({"kv_cache_memory": "lots"}, r"kv_cache_memory: not a size: 'lots'"),
    ({"kv_cache_memory": -1}, r"kv_cache_memory must be a positive number of bytes"),
    ({"kv_cache_memory": float("inf")}, r"kv_cache_memory must be a positive number of bytes"),
    ({"kv_cache_memory": True}, r"kv_cache_memory must be a positive number of bytes"),
])
def test_a_wrong_option_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_accepted_forms():
    assert EngineConfig(kv_cache_memory="1GiB").kv_cache_memory == 1 << 30  # as --kv-cache-memory takes it
    assert EngineConfig(kv_cache_memory=np.int64(1 << 20)).kv_cache_memory == 1 << 20
    assert EngineConfig(kv_cache_memory=1.5e9).kv_cache_memory == 1_500_000_000  # bytes as a float: as before
    config = EngineConfig(max_model_len=np.int32(512), seed=-1, num_threads=0, memory_utilization=1)
    assert (config.max_model_len, config.seed, config.num_threads) == (512, -1, 0)  # 0: every usable CPU
    assert type(config.max_model_len) is int  # numpy's int32 would overflow in the plan's products


def test_parse_size():
    assert parse_size("x", "1.5 GB") == 1_500_000_000 and parse_size("x", "512MiB") == 512 << 20
    with pytest.raises(ValueError, match="^x: a size must be positive"):
        parse_size("x", "0")
