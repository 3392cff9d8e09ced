"""The KV connector's worker side and config, in one process: blocks read out of one engine's
prefix cache and written into another's give the same greedy output as computing the prompt,
and the second engine computes only the prompt's tail."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.distributed.kv_transfer.blocks import PoolBlocks, layout_of, num_cached_blocks
from kvflow.distributed.kv_transfer.config import KVTransferConfig

from ..conftest import save_tiny_llama


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_moved_between_engines_give_the_same_output(tmp_path, dtype):
    path, _ = save_tiny_llama(tmp_path / "m")
    producer, consumer = (LLM(path, dtype=dtype, kv_cache_memory=4 << 20) for _ in range(2))
    prompt = [(7 * i) % 300 + 3 for i in range(53)]  # 3 full blocks before the last token
    params = SamplingParams(temperature=0, max_tokens=12)
    ref = producer.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    worker = PoolBlocks()
    found, payload = worker.save_blocks(producer.engine, prompt, skip=0)
    assert found == 3 and len(payload) == 3 * 2 * 2 * 16 * 2 * 16 * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    assert layout_of(producer.engine) == layout_of(consumer.engine)
    assert worker.load_blocks(consumer.engine, prompt, 0, found, payload) == 3
    assert num_cached_blocks(consumer.engine, prompt) == (3, 3)
    before = consumer.engine.get_stats().prefill_tokens
    out = consumer.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref and out.num_cached_tokens == 48
    assert consumer.engine.get_stats().prefill_tokens - before == 5
    consumer.engine.check_integrity()
    kv = consumer.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_kv_transfer_config_refusals_name_the_key():
    assert KVTransferConfig.parse('{"kv_role": "kv_producer", "kv_port": 0}').is_producer
    for text, words in [('{"kv_role": "kv_both"}', "kv_both"), ('{"kv_role": "x"}', "kv_role"),
                        ('{}', "kv_role is required"), ('{"kv_role": "kv_consumer", "kv_timeout_s": 0}', "kv_timeout_s"),
                        ('{"kv_role": "kv_consumer", "bogus": 1}', "bogus"), ("[1]", "JSON object"), ("{", "JSON"),
                        ('{"kv_role": "kv_producer", "kv_port": 70000}', "kv_port")]:
        with pytest.raises(ValueError, match=words):
            KVTransferConfig.parse(text)


@pytest.mark.parametrize(("options", "words"), [
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype='int8' blocks cannot be transferred"),
    ({"enable_prefix_caching": False}, "needs prefix caching"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
])
def test_an_engine_whose_blocks_cannot_move_names_the_setting(tmp_path, options, words):
    """Each cause has its own message (one message listing three causes left the user guessing)."""
    path, _ = save_tiny_llama(tmp_path / "m")
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, **options)
    with pytest.raises(ValueError, match=words):
        layout_of(llm.engine)
