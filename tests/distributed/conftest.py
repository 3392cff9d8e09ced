"""Tiny random Llamas for the distributed tests, and their transformers greedy references."""

from __future__ import annotations

import pytest
import torch

from kvflow.config import ModelConfig
from kvflow.distributed.config import ParallelConfig
from tests.conftest import hf_greedy, save_tiny_llama, shared_prefix_prompts

NEW_TOKENS = 10
BLOCK_SIZE = 16
NUM_BLOCKS = 9  # few enough that ten prompts of up to 80 tokens preempt each other
MAX_MODEL_LEN = 128


@pytest.fixture(autouse=True)
def _oversubscribe(monkeypatch):
    monkeypatch.setenv("KVFLOW_OVERSUBSCRIBE", "1")  # 4 ranks on this 2-core machine


def kv_memory_for(path: str, parallel: ParallelConfig) -> int:
    """kv_cache_memory (per rank) that gives every layout the same NUM_BLOCKS."""
    from kvflow.loader import load_model_config

    cfg: ModelConfig = load_model_config(path)
    per_token = max(parallel.rank_model_config(cfg, r).kv_bytes_per_token(torch.float32)
                    for r in range(parallel.world_size))
    return NUM_BLOCKS * BLOCK_SIZE * per_token


def engine_kwargs(path: str, tp: int = 1, pp: int = 1, backend: str | None = None) -> dict:
    return dict(dtype="float32", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=6,
                max_num_batched_tokens=48, num_threads=1, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                distributed_executor_backend=backend,
                kv_cache_memory=kv_memory_for(path, ParallelConfig(tp, pp)))


def _reference(tmp_path_factory, name: str, **shape):
    path, hf = save_tiny_llama(tmp_path_factory.mktemp(name), **shape)
    prompts = shared_prefix_prompts(7, 6, vocab=shape.get("vocab_size", 320))
    refs = [hf_greedy(hf, p, NEW_TOKENS)[:2] for p in prompts]
    return path, prompts, refs


@pytest.fixture(scope="session")
def tiny_gqa(tmp_path_factory):
    """4 query heads over 2 KV heads, 4 layers, a vocabulary of 317 (odd: the last shard is padded)."""
    return _reference(tmp_path_factory, "tp-gqa", num_hidden_layers=4, vocab_size=317)


@pytest.fixture(scope="session")
def tiny_mqa(tmp_path_factory):
    """4 query heads over 1 KV head: with T=2 each rank holds a replica of it."""
    return _reference(tmp_path_factory, "tp-mqa", num_hidden_layers=3, num_key_value_heads=1, vocab_size=317)


@pytest.fixture(scope="session")
def tiny_nine_heads(tmp_path_factory):
    """The default model's head shape (9 query heads over 3 KV heads) in miniature, for T=3."""
    return _reference(tmp_path_factory, "tp-nine", hidden_size=72, intermediate_size=96, num_attention_heads=9,
                      num_key_value_heads=3, num_hidden_layers=2, vocab_size=317)
