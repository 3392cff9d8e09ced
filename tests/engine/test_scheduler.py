"""Scheduler tests with a simulated model (no weights, no tensors).

The fake model mimics what matters about a real one: it writes one K/V "entry" per computed
token into the block table's slots, each entry derived from the entry of the previous
position *as read back from the cache* and the token itself, and it samples the next token
from the last entry. A sequence is therefore only generated correctly if every block the
scheduler and the prefix cache handed it holds the right history; recomputation after a
preemption gives the same tokens, and anything served wrongly from the cache changes them.
The model lives in fake_model.py, shared with test_scheduler_properties.py; the harness that drives
it in scheduler_harness.py. Preemption and priority: test_scheduler_preemption.py.
"""

from __future__ import annotations

import pytest

from kvflow.engine.sequence import SequenceStatus
from tests.engine.scheduler_harness import WORKLOAD, Harness, expected_outputs, load, prompt, reference_output


# ---- sanity of the harness ---------------------------------------------------------------


def test_unconstrained_run_matches_reference():
    h = Harness()
    load(h, WORKLOAD[:1])
    h.step()  # r0's prompt is computed and its full blocks published before the others arrive
    for i, (p, target, _) in enumerate(WORKLOAD[1:], 1):
        h.add(f"r{i}", p, target)
    h.run()
    assert h.outputs() == expected_outputs()
    assert h.sched.num_preemptions == 0
    assert h.kv.prefix_stats.hits > 0  # the shared prefixes were served from the cache


# ---- token budget, ordering, chunking ------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("use_priority", [False, True])
def test_token_budget_respected_every_step(budget, use_priority):
    h = Harness(num_blocks=24, max_num_batched_tokens=budget)
    load(h, use_priority=use_priority)
    steps = []

    def check(out):
        assert 0 < out.num_batched_tokens <= budget
        assert all(s.num_new_tokens >= 1 for s in out.scheduled)
        assert len({s.seq.request_id for s in out.scheduled}) == len(out.scheduled)
        steps.append(out.num_batched_tokens)

    h.run(each=check)
    assert h.outputs() == expected_outputs()
    if budget <= 3:
        assert max(steps) == budget  # the budget is used, not just respected


def test_decodes_come_first_and_are_served_before_prefills():
    h = Harness(max_num_batched_tokens=6)
    a = h.add("a", prompt(1, 3), 20, priority=1)
    b = h.add("b", prompt(2, 2), 20, priority=1)
    out, _ = h.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 3), (b, 2)]
    # a high-priority long prompt arrives: the two decodes still go first and take their token
    c = h.add("c", prompt(3, 20), 30, priority=0)
    out, _ = h.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1), (c, 4)]
    out, _ = h.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1), (c, 4)]
    for _ in range(10):
        out, _ = h.step()
        sizes = [s.num_new_tokens for s in out.scheduled]
        assert sizes == sorted(sizes, key=lambda n: n > 1)  # single-token rows first


def test_single_token_admission_is_listed_before_a_prefill_chunk():
    h = Harness(max_num_batched_tokens=6)
    a = h.add("a", prompt(1, 8), 10)
    h.step()  # 6 of a's 8 prompt tokens
    b = h.add("b", [5], 3)
    out, _ = h.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 1), (a, 2)]


def test_chunked_prefill_splits_long_prompt_and_samples_only_last_chunk():
    h = Harness(max_num_batched_tokens=8)
    seq = h.add("long", prompt(4, 20), 23)
    chunks = []
    for expected_computed in (8, 16, 20):
        out, sampled = h.step()
        assert len(out.scheduled) == 1
        item = out.scheduled[0]
        chunks.append(item.num_new_tokens)
        assert seq.num_computed_tokens == expected_computed
        assert (sampled == [seq]) == (expected_computed == 20)
    assert chunks == [8, 8, 4]
    assert len(seq.output_token_ids) == 1
    h.run()
    assert seq.output_token_ids == reference_output(prompt(4, 20), 23)


def test_chunked_prefill_shares_budget_with_a_second_prompt():
    h = Harness(max_num_batched_tokens=8)
    a = h.add("a", prompt(1, 10), 12)
    b = h.add("b", prompt(2, 10), 12)
    out, _ = h.step()
    assert [(s.seq, s.num_new_tokens, s.is_sampled) for s in out.scheduled] == [(a, 8, False)]
    out, _ = h.step()  # a's last 2 tokens, then b's first 6
    got = [(s.seq, s.num_new_tokens) for s in out.scheduled]
    assert got == [(a, 2), (b, 6)]
    assert len(a.output_token_ids) == 1 and b.output_token_ids == []
    h.run()
    assert h.outputs() == {"a": reference_output(prompt(1, 10), 12), "b": reference_output(prompt(2, 10), 12)}


def test_max_num_seqs_respected():
    h = Harness(max_num_seqs=2)
    load(h)

    def check(out):
        assert len(h.sched.running) <= 2
        assert len(out.scheduled) <= 2

    h.run(each=check)
    assert h.outputs() == expected_outputs()


def test_continuous_batching_admits_new_request_next_step():
    h = Harness(max_num_seqs=4)
    a = h.add("a", prompt(1, 4), 30)
    for _ in range(3):
        h.step()
    b = h.add("b", prompt(2, 6), 10)
    out, _ = h.step()
    assert [s.seq for s in out.scheduled] == [a, b]
    assert b.status == SequenceStatus.RUNNING and b in h.sched.running
    # b finishes while a keeps decoding; a request added after that is admitted at once too
    while not b.is_finished:
        h.step()
    assert not a.is_finished
    c = h.add("c", prompt(3, 2), 5)
    out, _ = h.step()
    assert c in [s.seq for s in out.scheduled]
    h.run()
    assert h.outputs() == {
        "a": reference_output(prompt(1, 4), 30),
        "b": reference_output(prompt(2, 6), 10),
        "c": reference_output(prompt(3, 2), 5),
    }


def test_finish_frees_blocks_at_once():
    h = Harness(num_blocks=16)
    a = h.add("a", prompt(1, 9), 12)
    b = h.add("b", prompt(2, 9), 30)
    h.step()
    assert len(h.kv.block_table("a")) == 3 and len(h.kv.block_table("b")) == 3
    while not a.is_finished:
        h.step()
    assert a.status == SequenceStatus.FINISHED_LENGTH and a.finished_time is not None
    assert h.kv.block_table("a") == [] and "a" not in h.kv.block_tables
    assert a not in h.sched.running
    assert h.kv.num_free_blocks == 16 - len(h.kv.block_table("b"))
    # an abort mid-run frees immediately too
    h.sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert h.kv.num_free_blocks == 16 and not h.sched.has_unfinished()
    assert b.finish_reason == "abort"
    h.kv.check_integrity()


def test_abort_waiting_request():
    h = Harness(max_num_seqs=1)
    a = h.add("a", prompt(1, 3), 8)
    b = h.add("b", prompt(2, 3), 8)
    h.step()
    assert b in h.sched.waiting
    h.sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert b not in h.sched.waiting and b.is_finished
    h.run()
    assert a.output_token_ids == reference_output(prompt(1, 3), 8)
    assert b.output_token_ids == []


def test_free_slots_for_admission():
    """What the server's admission may treat as free (Scheduler.free_slots): the slots a burst
    fills at the next step, and none once a step has left a sequence waiting, here for KV blocks
    (a full pool is not free room, however few sequences run)."""
    h = Harness(num_blocks=64, max_num_seqs=4)
    assert h.sched.free_slots() == 4
    h.add("a", prompt(0, 8), 12)
    assert h.sched.free_slots() == 4  # nothing scheduled yet: the next step takes it
    h.step()
    assert h.sched.free_slots() == 3
    small = Harness(num_blocks=4, block_size=4, max_num_seqs=4)
    small.add("big", prompt(1, 12), 14)
    small.add("next", prompt(2, 12), 14)  # 3 blocks each: only one fits the pool
    small.step()
    assert len(small.sched.running) == 1 and small.sched.waiting and small.sched.free_slots() == 0
