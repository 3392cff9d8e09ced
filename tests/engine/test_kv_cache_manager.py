"""Unit tests of the KV block pool bookkeeping: allocation, prefix cache, LRU eviction.

No model is involved: a sequence's tokens are "computed" by advancing its
`num_computed_tokens` and publishing its full blocks, exactly as
`Scheduler.update_after_step` does after a real forward pass.
"""

from __future__ import annotations

import pytest

from kvflow.engine.kv_cache_manager import BlockPool, KVCacheManager, hash_block
from kvflow.engine.scheduler import Scheduler, SchedulerConfig
from kvflow.engine.sequence import Sequence, SequenceStatus
from kvflow.sampling.params import SamplingParams

BS = 4


def make_seq(request_id: str, tokens) -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams())


def admit(kv: KVCacheManager, seq: Sequence) -> list:
    """Admit `seq` the way the scheduler does (prefix hits first), compute all of it, publish.

    Returns the prefix-cache hits it was admitted with.
    """
    cached = kv.find_cached_prefix(seq)
    seq.num_computed_tokens = len(cached) * kv.block_size
    assert kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens, cached)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    kv.check_integrity()
    return cached


def free_ids(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


def chain(blocks: list[list[int]]) -> list[bytes]:
    out, parent = [], None
    for tokens in blocks:
        parent = hash_block(parent, tokens)
        out.append(parent)
    return out


P1, P2, Q, R = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]


# ---- allocation -----------------------------------------------------------------------


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        KVCacheManager(0, BS)


def test_allocate_and_free_return_every_block():
    kv = KVCacheManager(8, BS)
    seqs = [make_seq(f"s{i}", range(100 * i, 100 * i + n)) for i, n in enumerate([1, 4, 5, 9])]
    expected = [1, 1, 2, 3]
    for seq, nb in zip(seqs, expected):
        before = kv.num_free_blocks
        assert kv.allocate_slots(seq, seq.num_tokens)
        assert len(kv.block_table(seq.request_id)) == nb == kv.blocks_needed(seq.num_tokens)
        assert kv.num_free_blocks == before - nb
        kv.check_integrity()
    held = [b for s in seqs for b in kv.block_table(s.request_id)]
    assert len(held) == len(set(held)) == 7  # no block handed out twice
    assert not set(held) & set(kv.pool.free_queue)
    for seq in seqs:
        kv.free(seq)
        kv.check_integrity()
        assert kv.block_table(seq.request_id) == []
    assert kv.num_free_blocks == 8
    assert sorted(kv.pool.free_queue) == list(range(8))
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_allocate_grows_table_incrementally():
    kv = KVCacheManager(8, BS)
    seq = make_seq("a", range(3))
    assert kv.allocate_slots(seq, 3)
    assert len(kv.block_table("a")) == 1
    seq.num_computed_tokens = 3
    for n in range(4, 10):  # decode one token at a time
        seq.output_token_ids.append(n)
        assert kv.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        assert len(kv.block_table("a")) == kv.blocks_needed(seq.num_computed_tokens)
        kv.check_integrity()


def test_allocate_slots_is_all_or_nothing():
    kv = KVCacheManager(4, BS)
    a = make_seq("a", range(12))
    assert kv.allocate_slots(a, 12)  # 3 of 4 blocks
    b = make_seq("b", range(100, 108))  # needs 2 blocks, 1 left
    free_before, queue_before = kv.num_free_blocks, free_ids(kv)
    assert not kv.can_allocate(b, 8)
    assert not kv.allocate_slots(b, 8)
    assert kv.num_free_blocks == free_before == 1
    assert free_ids(kv) == queue_before
    assert "b" not in kv.block_tables and kv.block_table("b") == []
    kv.check_integrity()
    # growing an existing table that does not fit leaves it untouched too
    a.num_computed_tokens = 12
    assert not kv.allocate_slots(a, 8)  # 5 blocks > 4
    assert len(kv.block_table("a")) == 3 and kv.num_free_blocks == 1
    kv.check_integrity()
    assert kv.allocate_slots(b, 4)  # but one block does fit
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_all_or_nothing_with_cached_prefix_leaves_hits_untaken():
    kv = KVCacheManager(4, BS)
    a = make_seq("a", P1 + Q + [0])
    admit(kv, a)
    kv.free(a)  # blocks of P1, Q are idle but cached
    hog = make_seq("hog", range(100, 104))
    assert kv.allocate_slots(hog, 4)  # takes the one unhashed free block first
    assert kv.num_free_blocks == 3
    b = make_seq("b", P1 + Q + list(range(200, 209)))  # 2 hits + 3 new blocks: needs 5 > 4
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    b.num_computed_tokens = 8
    assert not kv.allocate_slots(b, b.num_tokens - 8, hits)
    assert all(h.ref_cnt == 0 and h.block_id in kv.pool.free_queue for h in hits)
    assert kv.num_free_blocks == 3 and "b" not in kv.block_tables
    kv.check_integrity()
    # idle hits leave the free queue when taken, so they count against the free blocks
    c = make_seq("c", P1 + Q + list(range(300, 305)))  # 2 hits + 2 new = 4 blocks, 3 free
    hits = kv.find_cached_prefix(c)
    c.num_computed_tokens = 8
    assert not kv.can_allocate(c, 5, hits)
    d = make_seq("d", P1 + Q + list(range(400, 403)))  # 2 hits + 1 new block: fits exactly
    hits = kv.find_cached_prefix(d)
    d.num_computed_tokens = 8
    assert kv.allocate_slots(d, 3, hits)
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_usage_and_num_free_blocks():
    kv = KVCacheManager(10, BS)
    assert kv.usage == 0.0 and kv.num_free_blocks == 10
    a = make_seq("a", range(12))
    admit(kv, a)
    assert kv.num_free_blocks == 7 and kv.usage == pytest.approx(0.3)
    b = make_seq("b", range(12))  # shares a's first two blocks (the last token is never a hit)
    hits = admit(kv, b)
    assert len(hits) == 2
    assert kv.num_free_blocks == 6 and kv.usage == pytest.approx(0.4)  # shared blocks counted once
    kv.free(a)
    assert kv.num_free_blocks == 7
    kv.free(b)
    # idle cached blocks count as free
    assert kv.num_free_blocks == 10 and kv.usage == 0.0
    assert len(kv.pool.cached) == 3


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
