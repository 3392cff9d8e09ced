"""The ZMQ KV connector end to end in one process: a producer and a consumer `AsyncEngine` on a
tiny random Llama whose token budget (`max_num_batched_tokens`=32) splits a 150-token prompt into
five prefill steps. The consumer subscribes first; the producer streams each step's new full
blocks; the consumer's greedy output equals one instance's, with every full prompt block taken
from the transfer. A prefill that never comes, and a producer that is not there, make the
consumer compute the prompt itself, with the same output and its pool whole.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvflow.config import EngineConfig
from kvflow.distributed.kv_transfer import consumer, producer
from kvflow.distributed.kv_transfer.config import KVTransferConfig
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.sampling.params import SamplingParams

from ..conftest import save_tiny_llama

PROMPT = [(11 * i) % 300 + 3 for i in range(150)]  # 9 full blocks of 16 before the last token
PARAMS = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path, _ = save_tiny_llama(tmp_path_factory.mktemp("kv_stream") / "m")
    config = EngineConfig(model=str(path), dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=32,
                          num_threads=1)
    made = [AsyncEngine.from_config(config, kv_transfer_config=KVTransferConfig(kv_role=role, kv_timeout_s=20))
            for role in ("kv_producer", "kv_consumer")]
    reference = AsyncEngine.from_config(config)
    yield (*made, reference)
    for engine in (*made, reference):
        engine.shutdown()


async def run(engine, rid, prompt, params, kv=None):
    stream = await engine.add_request(rid, {"prompt_token_ids": prompt}, params, kv_transfer_params=kv)
    out = None
    async for out in stream:
        pass
    return out


def pool_whole(engine) -> bool:
    stats = engine.engine.get_stats()
    return stats.num_free_blocks == stats.num_blocks


def test_blocks_stream_while_the_prompt_is_computed(engines):
    prod, cons, ref_engine = engines

    async def main():
        ref = await run(ref_engine, "ref", PROMPT, PARAMS)
        decode = asyncio.ensure_future(run(cons, "d", PROMPT, PARAMS, {"do_remote_prefill": True,
                                                                        "remote_kv_addr": prod.kv_connector.address}))
        while not prod.kv_connector._subs:  # the consumer has subscribed: now the prefill starts
            await asyncio.sleep(0.01)
        await run(prod, "p", PROMPT, SamplingParams(temperature=0, max_tokens=1), {"do_remote_decode": True})
        return ref, await decode

    ref, out = asyncio.run(main())
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.num_cached_tokens == 9 * 16  # every full prompt block came over
    stats = cons.kv_connector.stats
    assert stats.blocks == 9 and stats.failures == 0
    assert stats.chunks >= 4  # one frame per prefill step that completed blocks (32 tokens = 2 blocks)
    assert prod.kv_connector.stats.chunks == stats.chunks
    assert pool_whole(cons) and pool_whole(prod)
    cons.engine.check_integrity()


@pytest.mark.parametrize("where", ["no prefill", "no producer"])
def test_the_consumer_computes_the_prompt_when_no_blocks_come(engines, monkeypatch, where):
    prod, cons, ref_engine = engines
    monkeypatch.setattr(producer, "GRACE_S", 0.5)
    # With a producer, its refusal after GRACE_S is what must end the wait, not the consumer's own
    # silence limit (heartbeats come every 0.25 s; a stalled CI machine may miss one).
    monkeypatch.setattr(consumer, "SILENCE_S", 0.5 if where == "no producer" else 5.0)
    prompt = [t + 1 + (where == "no producer") for t in PROMPT]  # cached nowhere yet
    addr = prod.kv_connector.address if where == "no prefill" else "tcp://127.0.0.1:9"
    before = cons.kv_connector.stats.failures

    async def main():
        ref = await run(ref_engine, f"ref-{where}", prompt, PARAMS)
        out = await asyncio.wait_for(run(cons, f"d-{where}", prompt, PARAMS,
                                         {"do_remote_prefill": True, "remote_kv_addr": addr}), 10)
        return ref, out

    ref, out = asyncio.run(main())
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.num_cached_tokens == 0
    assert cons.kv_connector.stats.failures == before + 1
    deadline = time.monotonic() + 5  # the producer drops the subscription at its next tick
    while prod.kv_connector._subs and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool_whole(cons) and not prod.kv_connector._subs
