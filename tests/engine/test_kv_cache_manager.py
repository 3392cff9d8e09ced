"""Unit tests of the KV block pool bookkeeping: allocation and usage (the prefix cache and its
LRU eviction: test_kv_cache_manager_prefix.py).

No model is involved: a sequence's tokens are "computed" by advancing its
`num_computed_tokens` and publishing its full blocks, exactly as
`Scheduler.update_after_step` does after a real forward pass.
"""

from __future__ import annotations

import pytest

from kvflow.engine.kv_cache_manager import KVCacheManager, hash_block
from kvflow.engine.sequence import Sequence
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
