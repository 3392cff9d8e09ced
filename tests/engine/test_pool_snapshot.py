"""The block pool snapshot the dashboard draws (engine/pool_snapshot.py), against the manager's
own bookkeeping at every step of a run with a shared prefix: each block's state follows from
its reference count and hash, held blocks name a holder, and the counts add up."""

from __future__ import annotations

import numpy as np

from kvflow import SamplingParams
from kvflow.config import EngineConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.pool_snapshot import CACHED, FREE, IN_USE, SHARED, take_snapshot


def _check(engine: LLMEngine) -> None:
    kv, sched = engine.kv_cache_manager, engine.scheduler
    snap = take_snapshot(kv, list(sched.running), list(sched.waiting))
    assert snap.num_blocks == kv.num_blocks and snap.block_size == kv.block_size
    for block in kv.pool.blocks:
        state = snap.states[block.block_id]
        expected = (SHARED if block.ref_cnt >= 2 else IN_USE if block.ref_cnt == 1
                    else CACHED if block.block_hash is not None else FREE)
        assert state == expected, block
        assert (snap.owners[block.block_id] > 0) == (block.ref_cnt > 0), block
    counts = snap.counts()
    assert sum(counts.values()) == kv.num_blocks
    assert counts["free"] + counts["cached"] == kv.num_free_blocks
    for i, view in enumerate(snap.requests):
        table = kv.block_table(view.request_id)
        assert view.num_blocks == len(table)
        # every block a request holds is coloured by it or by an earlier holder of a shared block
        assert all(0 < snap.owners[b] <= i + 1 for b in table)
        assert view.status in ("running", "waiting")


def test_snapshot_follows_the_pool_through_a_run(tiny_models):
    path, _ = tiny_models("llama")
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_memory=1 << 20, max_model_len=96,
                                    max_num_batched_tokens=32))
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 300, size=40).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    engine.add_request("first", {"prompt_token_ids": shared + [5]}, params)
    saw_shared = False
    for step in range(200):
        if step == 3:  # once the prefix is cached, two more requests share it
            for i in range(2):
                engine.add_request(f"later-{i}", {"prompt_token_ids": shared + [7 + i, 9]}, params)
        if not engine.has_unfinished_requests():
            break
        engine.step()
        _check(engine)
        kv = engine.kv_cache_manager
        saw_shared |= any(b.ref_cnt >= 2 for b in kv.pool.blocks)
    assert saw_shared, "the shared prefix was never held by two requests at once"
    snap = take_snapshot(engine.kv_cache_manager, [], [])
    counts = snap.counts()
    assert counts["in_use"] == counts["shared"] == 0 and counts["cached"] >= 2 and not snap.owners.any()
