"""Scheduler tests with the fake model (scheduler_harness.py): preemption (victim choice,
recomputation giving the same tokens), priority, admission headroom, and draft tokens under a
tight budget. A wrongly freed or reused block changes the fake model's tokens.
"""

from __future__ import annotations

import pytest

from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.scheduler import Scheduler, SchedulerConfig
from kvflow.engine.sequence import Sequence, SequenceStatus
from kvflow.sampling.params import SamplingParams
from tests.engine.scheduler_harness import Harness, expected_outputs, load, prompt, reference_output


# ---- preemption -------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_victim_is_latest_arrival_and_requeued_in_front(prefix_caching):
    h = Harness(num_blocks=4, block_size=4, enable_prefix_caching=prefix_caching)
    a = h.add("a", prompt(1, 7), 14)
    b = h.add("b", prompt(2, 7), 14)
    h.step()  # both prompts: 2 blocks each, the pool is full
    assert h.kv.num_free_blocks == 0
    h.step()  # both decode into their second block
    assert a.num_computed_tokens == b.num_computed_tokens == 8
    c = h.add("c", prompt(3, 3), 6)  # arrives after b
    out, _ = h.step()  # a needs a third block: b is preempted for it
    assert out.preempted == [b]
    assert [s.seq for s in out.scheduled] == [a]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and h.sched.num_preemptions == 1
    assert h.kv.block_table("b") == []
    assert h.sched.waiting == [b, c]  # in front of the later arrival
    assert len(b.output_token_ids) == 2  # generated tokens are kept and recomputed
    h.run()
    assert h.outputs() == {
        "a": reference_output(prompt(1, 7), 14),
        "b": reference_output(prompt(2, 7), 14),
        "c": reference_output(prompt(3, 3), 6),
    }
    assert a.num_preemptions == 0


def test_preempted_victim_already_scheduled_this_step_is_unscheduled():
    # b has the larger priority value, so it is the victim although it arrived first;
    # it is a decode, so it was scheduled before a's prefill chunk asked for a block.
    h = Harness(num_blocks=4, block_size=4, max_num_batched_tokens=4)
    b = h.add("b", prompt(2, 3), 12, priority=1)
    h.step()
    a = h.add("a", prompt(1, 13), 15, priority=0)
    h.step()  # b decodes (1 token), a is admitted with 3
    h.step()  # b: 1, a: 3 more
    assert h.kv.num_free_blocks == 0
    c = h.add("c", prompt(3, 2), 4, priority=0)  # waits: no block is free
    out, _ = h.step()  # a needs a third block
    assert out.preempted == [b]
    assert b.status == SequenceStatus.WAITING and b not in h.sched.running
    # b's token goes back to the budget: with it, c's first token fits in b's freed block
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(c, 1), (a, 3)]
    assert h.sched.running == [a, c] and h.sched.waiting == [b]
    h.run()
    assert a.output_token_ids == reference_output(prompt(1, 13), 15)
    assert b.output_token_ids == reference_output(prompt(2, 3), 12)
    assert c.output_token_ids == reference_output(prompt(3, 2), 4)


def test_self_preempted_request_is_not_readmitted_in_the_same_step():
    h = Harness(num_blocks=5, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False)
    a = h.add("a", prompt(1, 4), 20)
    b = h.add("b", prompt(2, 12), 14, priority=1)
    h.step()  # a: 4 tokens (1 block); b: 4 of its 12 (1 block)
    h.step()  # a: 1 (2 blocks); b: 7 more (3 blocks): the pool is full
    h.step()  # a: 1; b: its last prompt token, sampled
    assert h.kv.num_free_blocks == 0 and len(b.output_token_ids) == 1
    out, _ = h.step()  # b needs a 4th block; it is the lowest-priority running sequence itself
    assert out.preempted == [b]
    assert [s.seq for s in out.scheduled] == [a]
    # 3 blocks are free and the budget would admit b's first chunk, but it waits a step
    assert h.kv.num_free_blocks == 3 and h.sched.waiting == [b]
    out, _ = h.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 7)]
    h.run()
    assert a.output_token_ids == reference_output(prompt(1, 4), 20)
    assert b.output_token_ids == reference_output(prompt(2, 12), 14)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks,budget", [(7, 2048), (7, 5), (9, 3), (12, 8)])
@pytest.mark.parametrize("use_priority", [False, True])
def test_preemption_completes_everything_with_unconstrained_tokens(prefix_caching, num_blocks, budget, use_priority):
    free = Harness(enable_prefix_caching=prefix_caching)
    load(free, use_priority=use_priority)
    free.run()
    tight = Harness(num_blocks=num_blocks, max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching)
    load(tight, use_priority=use_priority)
    preempted_order = []

    def check(out):
        for victim in out.preempted:
            # the victim is the running sequence with the largest (priority, arrival)
            assert victim.status == SequenceStatus.WAITING
            assert all(s.sort_key() < victim.sort_key() for s in tight.sched.running)
            assert victim not in [s.seq for s in out.scheduled]
            preempted_order.append(victim.request_id)

    tight.run(each=check)
    assert tight.sched.num_preemptions > 0
    assert tight.sched.num_preemptions == sum(s.num_preemptions for s in tight.seqs.values())
    assert tight.outputs() == free.outputs() == expected_outputs()
    assert all(s.status == SequenceStatus.FINISHED_LENGTH for s in tight.seqs.values())


# ---- priority ------------------------------------------------------------------------------


def test_priority_changes_admission_order():
    h = Harness(max_num_seqs=1)
    low = h.add("low", prompt(1, 3), 6, priority=5)
    mid = h.add("mid", prompt(2, 3), 6, priority=1)
    high = h.add("high", prompt(3, 3), 6, priority=0)
    late_high = h.add("late_high", prompt(4, 3), 6, priority=0)
    assert h.sched.waiting == [high, late_high, mid, low]
    order = []
    h.run(each=lambda out: order.append(out.scheduled[0].seq.request_id))
    firsts = list(dict.fromkeys(order))
    assert firsts == ["high", "late_high", "mid", "low"]


def test_priority_chooses_the_victim():
    h = Harness(num_blocks=4, block_size=4)
    early_low = h.add("early_low", prompt(1, 7), 14, priority=3)
    late_high = h.add("late_high", prompt(2, 7), 14, priority=0)
    h.step()
    h.step()
    out, _ = h.step()
    assert out.preempted == [early_low]  # the earlier arrival, but the larger priority value
    assert h.sched.running == [late_high]
    h.run()
    assert early_low.output_token_ids == reference_output(prompt(1, 7), 14)
    assert late_high.output_token_ids == reference_output(prompt(2, 7), 14)
    assert late_high.num_preemptions == 0


def test_admission_keeps_decode_headroom():
    """With headroom, the second prompt waits instead of filling the pool and being preempted."""
    h = Harness(num_blocks=4, block_size=4, headroom=1)
    h.add("a", prompt(1, 7), 14)
    h.add("b", prompt(2, 7), 14)
    h.step()
    assert [s.request_id for s in h.sched.running] == ["a"]
    assert h.kv.num_free_blocks == 2
    h.run()
    assert h.sched.num_preemptions == 0


def _decoding(i: int, kv: KVCacheManager, length: int = 7) -> Sequence:
    """A running sequence whose tokens all have K/V but the last (a decode is due)."""
    seq = Sequence(f"d{i}", list(range(1, length + 1)), SamplingParams(max_tokens=100))
    seq.num_computed_tokens = length - 1
    assert kv.allocate_slots(seq, 0)
    return seq


def test_drafts_take_only_what_every_decode_left():
    """Drafts come last: a tight budget still decodes every sequence, and drafts never preempt."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv)
    seqs = [_decoding(i, kv) for i in range(10)]
    for seq in seqs:
        sched.add(seq)
        sched.waiting.remove(seq)
        sched.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        seq.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    assert len(out.scheduled) == 10 and not out.preempted
    assert out.num_batched_tokens == 16  # ten own tokens, six drafts from what was left
    assert sum(len(it.spec_token_ids) for it in out.scheduled) == 6
    assert all(s.spec_token_ids == [] for s in seqs)  # taken (or dropped) by the scheduler


def test_drafts_never_take_the_block_another_decode_needs():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv)
    first = _decoding(0, kv, length=6)  # 2 blocks; room for its own token in the second
    second = _decoding(1, kv, length=9)  # 2 blocks; its own token needs a third
    for seq in (first, second):
        sched.add(seq)
        sched.waiting.remove(seq)
        sched.running.append(seq)
        seq.status = SequenceStatus.RUNNING
    first.spec_token_ids = [1, 2, 3, 4]  # would need a new block
    assert kv.num_free_blocks == 1
    out = sched.schedule()
    assert not out.preempted
    assert {it.seq.request_id: it.spec_token_ids for it in out.scheduled} == {"d0": [], "d1": []}
