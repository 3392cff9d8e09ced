"""Unit tests of the KV block pool's prefix cache: hits, hash chains, LRU eviction, statistics.

As in test_kv_cache_manager.py (whose helpers these share), no model is involved: a sequence's
tokens are "computed" by advancing `num_computed_tokens` and publishing its full blocks.
"""

from __future__ import annotations

import pytest

from kvflow.engine.kv_cache_manager import BlockPool, KVCacheManager, hash_block
from kvflow.engine.scheduler import Scheduler, SchedulerConfig
from kvflow.engine.sequence import SequenceStatus

from tests.engine.test_kv_cache_manager import BS, P1, P2, Q, R, admit, chain, free_ids, make_seq


# ---- prefix cache -----------------------------------------------------------------------


def test_no_hit_when_nothing_shared():
    kv = KVCacheManager(16, BS)
    admit(kv, make_seq("a", P1 + Q + R + [0]))
    assert kv.find_cached_prefix(make_seq("b", P2 + Q + R + [0])) == []


def test_hits_for_some_shared_blocks():
    kv = KVCacheManager(16, BS)
    a = make_seq("a", P1 + Q + R + [0])
    admit(kv, a)
    a_table = kv.block_table("a")
    b = make_seq("b", P1 + Q + P2 + [0])
    hits = admit(kv, b)
    assert [h.block_id for h in hits] == a_table[:2]
    assert kv.block_table("b")[:2] == a_table[:2]
    assert kv.block_table("b")[2] not in a_table
    assert [kv.pool.blocks[i].ref_cnt for i in a_table] == [2, 2, 1, 1]


def test_hits_for_all_full_blocks():
    kv = KVCacheManager(16, BS)
    a = make_seq("a", P1 + Q + R + [0])
    admit(kv, a)
    b = make_seq("b", P1 + Q + R + [7, 8])
    hits = admit(kv, b)
    assert [h.block_id for h in hits] == kv.block_table("a")[:3]
    assert b.num_computed_tokens == 14


def test_a_partial_block_is_never_cached():
    kv = KVCacheManager(16, BS)
    a = make_seq("a", P1 + [1, 2, 3])
    admit(kv, a)
    assert len(kv.pool.cached) == 1  # only the full block
    assert kv.pool.blocks[kv.block_table("a")[1]].block_hash is None


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(16, BS)
    a = make_seq("a", P1 + Q + R)
    admit(kv, a)
    assert len(kv.pool.cached) == 3
    b = make_seq("b", P1 + Q + R)  # every block is cached ...
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2  # ... but the block holding the last token is not served
    one = make_seq("one", P1)
    assert kv.find_cached_prefix(one) == []
    # through the scheduler: the prompt is admitted with 8 cached tokens and computes 4
    sched = Scheduler(SchedulerConfig(), kv)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens, s.is_sampled) for s in out.scheduled] == [(b, 4, True)]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8


def test_hit_needs_identical_tokens():
    kv = KVCacheManager(16, BS)
    admit(kv, make_seq("a", P1 + Q + R + [0]))
    q_changed = Q[:3] + [99]
    assert len(kv.find_cached_prefix(make_seq("b", P1 + q_changed + R + [0]))) == 1
    assert kv.find_cached_prefix(make_seq("c", [99] + P1[1:] + Q + R + [0])) == []


def test_hit_needs_identical_prefix_chain():
    kv = KVCacheManager(16, BS)
    a = make_seq("a", P1 + Q + [0])
    admit(kv, a)
    c = make_seq("c", P2 + R + [0])  # caches P2 at position 0
    admit(kv, c)
    # b's second block holds exactly the tokens of a's second block, but after another prefix
    b = make_seq("b", P2 + Q + [0])
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits] == kv.block_table("c")[:1]
    # the block of Q after P1 is not reachable by hash from P2, even when looked up directly
    assert kv.pool.lookup(chain([P2, Q])[1], Q, chain([P2])[0]) is None
    assert kv.pool.lookup(chain([P1, Q])[1], Q, chain([P1])[0]).block_id == kv.block_table("a")[1]
    # a forged index entry: the right tokens under another prefix's hash are still refused
    kv.pool.cached[chain([P2, Q])[1]] = kv.block_table("a")[1]
    assert kv.pool.lookup(chain([P2, Q])[1], Q, chain([P2])[0]) is None
    # and the same tokens at position 0 (no parent) are not the block after P1 either
    assert kv.find_cached_prefix(make_seq("d", Q + [0])) == []


def test_output_tokens_extend_the_chain():
    kv = KVCacheManager(16, BS)
    a = make_seq("a", P1 + Q[:2])
    admit(kv, a)
    a.output_token_ids += Q[2:] + [0]  # generated tokens complete the second block
    assert kv.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    a.output_token_ids.append(1)
    assert kv.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    kv.cache_full_blocks(a)
    b = make_seq("b", P1 + Q + [5])
    assert [h.block_id for h in kv.find_cached_prefix(b)] == kv.block_table("a")[:2]


def test_forged_hash_collision_is_never_served():
    kv = KVCacheManager(16, BS)
    a = make_seq("a", P1 + Q + [0])
    admit(kv, a)
    victim_block = kv.block_table("a")[0]  # holds P1
    # pretend the hash of P2 (and of the chain P2, R) collides with a's blocks
    forged = chain([P2, R])
    kv.pool.cached[forged[0]] = victim_block
    kv.pool.cached[forged[1]] = kv.block_table("a")[1]
    assert kv.pool.lookup(forged[0], P2, None) is None
    b = make_seq("b", P2 + R + [0])
    assert kv.find_cached_prefix(b) == []
    # the honest entries still work
    assert len(kv.find_cached_prefix(make_seq("c", P1 + Q + [0]))) == 2
    # b computes its own blocks and nothing of a's is reused or overwritten
    b.num_computed_tokens = 0
    assert kv.allocate_slots(b, b.num_tokens)
    assert not set(kv.block_table("b")) & set(kv.block_table("a"))
    assert kv.pool.blocks[victim_block].token_ids == tuple(P1)


def test_free_publishes_nothing_and_cached_blocks_survive_free():
    kv = KVCacheManager(8, BS)
    a = make_seq("a", P1 + Q + [0])
    admit(kv, a)
    table = kv.block_table("a")
    kv.free(a)
    assert kv.num_free_blocks == 8
    hits = kv.find_cached_prefix(make_seq("b", P1 + Q + [1]))
    assert [h.block_id for h in hits] == table[:2]


def test_shared_block_survives_one_holder_freeing():
    kv = KVCacheManager(8, BS)
    a = make_seq("a", P1 + Q + [0])
    b = make_seq("b", P1 + Q + [1])
    admit(kv, a)
    admit(kv, b)
    shared = kv.block_table("a")[:2]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert not set(shared) & set(kv.pool.free_queue)
    kv.check_integrity()
    kv.free(b)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_prefix_caching_disabled():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    admit(kv, make_seq("a", P1 + Q + [0]))
    assert kv.pool.cached == {}
    assert kv.find_cached_prefix(make_seq("b", P1 + Q + [0])) == []


# ---- LRU eviction ------------------------------------------------------------------------


def test_unhashed_free_blocks_are_used_before_cached_ones():
    kv = KVCacheManager(6, BS)
    a = make_seq("a", P1 + Q)  # 2 blocks, both full and cached
    admit(kv, a)
    a_blocks = kv.block_table("a")
    kv.free(a)
    # partial (unhashed) block freed after a: it still goes in front of a's cached blocks
    p = make_seq("p", [77])
    admit(kv, p)
    p_block = kv.block_table("p")[0]
    kv.free(p)
    assert free_ids(kv)[0] == p_block
    assert free_ids(kv)[-2:] == [a_blocks[1], a_blocks[0]]  # tail released first
    # 4 unhashed blocks are free: taking all 4 evicts nothing
    hog = make_seq("hog", range(100, 116))
    assert kv.allocate_slots(hog, 16)
    assert not set(kv.block_table("hog")) & set(a_blocks)
    assert len(kv.find_cached_prefix(make_seq("b", P1 + Q + [0]))) == 2
    # the next block evicts a's tail first (it was released first), the head survives
    more = make_seq("more", range(200, 204))
    assert kv.allocate_slots(more, 4)
    assert kv.block_table("more") == [a_blocks[1]]
    assert kv.pool.blocks[a_blocks[1]].block_hash is None
    assert [h.block_id for h in kv.find_cached_prefix(make_seq("b", P1 + Q + [0]))] == [a_blocks[0]]
    assert len(kv.pool.cached) == 1
    kv.check_integrity()


def test_least_recently_freed_cached_block_is_evicted_first():
    kv = KVCacheManager(4, BS)
    a = make_seq("a", P1 + [0])
    b = make_seq("b", P2 + [0])
    c = make_seq("c", R + [0])
    admit(kv, a)
    admit(kv, b)
    a_block, b_block = kv.block_table("a")[0], kv.block_table("b")[0]
    kv.free(a)  # a's P1 block is idle before b's
    kv.free(b)
    # reusing a's block moves it to the most-recently-freed end when it is idle again
    a2 = make_seq("a2", P1 + [1])
    assert [h.block_id for h in admit(kv, a2)] == [a_block]
    kv.free(a2)
    order = free_ids(kv)
    assert order.index(b_block) < order.index(a_block)
    # fill the pool: 2 unhashed blocks, then b's (least recently freed), then a's
    admit(kv, c)  # 2 blocks: the unhashed ones
    assert not {b_block, a_block} & set(kv.block_table("c"))
    d = make_seq("d", range(300, 304))
    assert kv.allocate_slots(d, 4)
    assert kv.block_table("d") == [b_block]
    assert kv.find_cached_prefix(make_seq("bb", P2 + [0])) == []
    assert len(kv.find_cached_prefix(make_seq("aa", P1 + [0]))) == 1
    e = make_seq("e", range(400, 404))
    assert kv.allocate_slots(e, 4)
    assert kv.block_table("e") == [a_block]
    assert kv.find_cached_prefix(make_seq("aa", P1 + [0])) == []
    assert kv.pool.cached == {hash_block(None, R): kv.block_table("c")[0]}
    kv.check_integrity()


def test_evicted_block_can_be_recached_under_new_hash():
    kv = KVCacheManager(1, BS)
    a = make_seq("a", P1)
    admit(kv, a)
    kv.free(a)
    b = make_seq("b", P2)
    admit(kv, b)
    kv.free(b)
    assert kv.pool.cached == {hash_block(None, P2): 0}
    assert kv.pool.blocks[0].token_ids == tuple(P2)
    assert kv.find_cached_prefix(make_seq("x", P1 + [0])) == []
    assert len(kv.find_cached_prefix(make_seq("y", P2 + [0]))) == 1


def test_block_pool_release_underflow_is_caught():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.release(block)
    with pytest.raises(AssertionError):
        pool.release(block)


# ---- statistics --------------------------------------------------------------------------


def test_prefix_stats_count_first_admission_only():
    kv = KVCacheManager(4, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    a = make_seq("a", P1 + Q + [0])
    sched.add(a)
    sched.update_after_step(sched.schedule())
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (9, 0)
    sched.finish(a, SequenceStatus.FINISHED_LENGTH)
    b = make_seq("b", P1 + Q + R)
    sched.add(b)
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4
    assert b.num_cached_tokens == 8
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (9 + 12, 8)
    sched.update_after_step(out)
    # preempt b and re-admit it: the re-admission is not a new query
    sched._preempt(b)
    sched.schedule()
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (21, 8)
    assert b.num_cached_tokens == 8


def test_record_prefix_lookup_accumulates():
    kv = KVCacheManager(4, BS)
    kv.record_prefix_lookup(10, 4)
    kv.record_prefix_lookup(6, 0)
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (16, 4)
