"""Scheduler tests with a simulated model (no weights, no tensors).

The fake model mimics what matters about a real one: it writes one K/V "entry" per computed
token into the block table's slots, each entry derived from the entry of the previous
position *as read back from the cache* and the token itself, and it samples the next token
from the last entry. A sequence is therefore only generated correctly if every block the
scheduler and the prefix cache handed it holds the right history; recomputation after a
preemption gives the same tokens, and anything served wrongly from the cache changes them.
The model lives in fake_model.py, shared with test_scheduler_properties.py.
"""

from __future__ import annotations

import pytest

from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvflow.engine.sequence import Sequence, SequenceStatus
from kvflow.sampling.params import SamplingParams
from tests.engine import fake_model
from tests.engine.fake_model import FakeModel

VOCAB = 50


def reference_output(prompt: list[int], target_len: int) -> list[int]:
    """What the fake model generates for `prompt` without any cache: the ground truth."""
    return fake_model.reference_output(prompt, target_len, VOCAB)


class Harness:
    """A scheduler, a KV cache manager and the fake model, driven like LLMEngine.step()."""

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        headroom: int = 0,  # most tests build exact pool states; headroom has its own test
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, admission_headroom_blocks=headroom), self.kv
        )
        self.model = FakeModel(self.kv, VOCAB)
        self.targets: dict[str, int] = {}
        self.seqs: dict[str, Sequence] = {}
        self.num_steps = 0

    def add(self, request_id: str, prompt: list[int], target_len: int, priority: int = 0) -> Sequence:
        assert target_len > len(prompt)
        seq = Sequence(request_id, list(prompt), SamplingParams(), priority=priority)
        self.targets[request_id] = target_len
        self.seqs[request_id] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> tuple[SchedulerOutput, list[Sequence]]:
        out = self.sched.schedule()
        sampled = self.model.execute(out)  # is_sampled is read before the update
        self.sched.update_after_step(out)
        for seq, token in sampled:
            assert seq.num_computed_tokens == seq.num_tokens
            seq.output_token_ids.append(token)
            if seq.num_tokens >= self.targets[seq.request_id]:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        self.kv.check_integrity()
        self.num_steps += 1
        return out, [s for s, _ in sampled]

    def run(self, max_steps: int = 10_000, each=None) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_unfinished():
            assert len(outs) < max_steps, "the scheduler stopped making progress"
            out, _ = self.step()
            assert not out.is_empty, "an empty step while requests are pending"
            if each is not None:
                each(out)
            outs.append(out)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        return outs

    def outputs(self) -> dict[str, list[int]]:
        return {rid: list(seq.output_token_ids) for rid, seq in self.seqs.items()}


def prompt(start: int, n: int) -> list[int]:
    return [(start + 7 * i) % VOCAB for i in range(n)]


WORKLOAD = [  # (prompt, target length, priority); shared prefixes so the prefix cache is used
    (prompt(0, 13), 20, 0),
    (prompt(0, 13) + [3, 4], 22, 0),
    (prompt(5, 3), 15, 1),
    (prompt(0, 8) + prompt(9, 9), 24, 0),
    (prompt(11, 21), 26, 2),
    (prompt(5, 3), 9, 0),
    (prompt(2, 1), 12, 1),
    (prompt(0, 13), 17, 0),
]


def load(h: Harness, workload=WORKLOAD, use_priority: bool = False) -> None:
    for i, (p, target, prio) in enumerate(workload):
        h.add(f"r{i}", p, target, prio if use_priority else 0)


def expected_outputs(workload=WORKLOAD) -> dict[str, list[int]]:
    return {f"r{i}": reference_output(p, target) for i, (p, target, _) in enumerate(workload)}


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
