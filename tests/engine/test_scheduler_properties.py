"""Property test: random interleavings of add / step / abort keep the KV bookkeeping sound.

A hypothesis state machine drives a Scheduler + KVCacheManager with a simulated model over a
random tiny configuration (a few blocks of 1-4 tokens, 1-4 sequences, a 1-16 token budget),
with prompts drawn from a small set of shared prefixes so that prefix hits, evictions and
preemptions are all frequent. After every operation it checks the pool against a model of
its own; once adds stop, stepping must finish everything within a bounded number of steps
and hand every block back, and every completed request must have generated exactly what an
uncached, unpreempted run generates.

The simulated model writes one K/V entry per computed token into the block table's slots,
derived from the entry of the previous position as read back from the cache, and samples
from the last one (see fake_model.py): a block served with the wrong history changes
the generated tokens, and writing into a shared or published block is caught on the spot.
"""

from __future__ import annotations

import random

import pytest

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow.engine.kv_cache_manager import KVCacheManager, hash_block
from kvflow.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvflow.engine.sequence import Sequence, SequenceStatus
from kvflow.sampling.params import SamplingParams
from tests.engine import fake_model
from tests.engine.fake_model import FakeModel, expected_entries

VOCAB = 4  # tiny, so identical blocks after different prefixes are common


def reference_output(prompt: list[int], target_len: int) -> list[int]:
    return fake_model.reference_output(prompt, target_len, VOCAB)


PREFIXES = [
    [],
    [1, 2, 3, 0, 1, 2, 3, 0, 3, 3, 2, 2],
    [1, 2, 3, 0, 1, 2, 3, 0, 0, 1, 1, 2],
    [1, 2, 3, 0, 2, 2, 2, 2],
    [2, 2, 2, 2, 2, 2, 2, 2, 2],
]
MAX_ADDS = 10


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 8),
        block_size=st.integers(1, 4),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(1, 16),
        prefix_caching=st.booleans(),
        headroom=st.integers(0, 1),
    )
    def setup(self, num_blocks, block_size, max_num_seqs, budget, prefix_caching, headroom=0):
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, admission_headroom_blocks=headroom), self.kv)
        self.model = FakeModel(self.kv, VOCAB)
        self.capacity = num_blocks * block_size
        self.seqs: list[Sequence] = []
        self.targets: dict[str, int] = {}
        self.known: dict[bytes, tuple[tuple[int, ...], list[int]]] = {}  # chain hash -> tokens, entries
        self.healthy = True  # False while an operation is under way: teardown then skips the drain

    # ---- operations ------------------------------------------------------------------------
    @precondition(lambda self: len(self.seqs) < MAX_ADDS)
    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        cut=st.integers(1, 12),
        suffix=st.lists(st.integers(0, VOCAB - 1), max_size=6),
        extra=st.integers(1, 10),
        priority=st.integers(0, 2),
    )
    def add(self, prefix, cut, suffix, extra, priority):
        if self.capacity < 2:
            return  # not even a one-token prompt plus one generated token fits in the pool
        self.healthy = False
        # every request fits in the pool on its own: prompt + generated tokens <= capacity
        tokens = (PREFIXES[prefix][:cut] + suffix) or [0]
        tokens = tokens[: self.capacity - 1]
        target = min(len(tokens) + extra, self.capacity)
        seq = Sequence(f"r{len(self.seqs)}", tokens, SamplingParams(), priority=priority)
        self.seqs.append(seq)
        self.targets[seq.request_id] = target
        self.sched.add(seq)
        self.healthy = True

    @rule(times=st.integers(1, 4))
    def step(self, times):
        self.healthy = False
        for _ in range(times):
            self._step()
            if times > 1:
                self.bookkeeping_is_sound()
        self.healthy = True

    @precondition(lambda self: any(not s.is_finished for s in self.seqs))
    @rule(data=st.data(), chance=st.integers(0, 2))
    def abort(self, data, chance):
        if chance:  # abort only a third of the times the rule is picked: let requests run
            return
        self._abort(data.draw(st.sampled_from([s for s in self.seqs if not s.is_finished]), label="abort"))

    def _abort(self, seq: Sequence) -> None:
        self.healthy = False
        self.sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        assert seq.is_finished and self.kv.block_table(seq.request_id) == []
        self.healthy = True

    def _step(self) -> SchedulerOutput:
        pending = self.sched.has_unfinished()
        out = self.sched.schedule()
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.config.max_num_seqs
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        assert not pending or not out.is_empty, "an empty step while requests are pending"
        sizes = [s.num_new_tokens for s in out.scheduled]
        assert sizes == sorted(sizes, key=lambda n: n > 1), "single-token rows come first"
        for victim in out.preempted:
            assert victim.status == SequenceStatus.WAITING and victim.num_computed_tokens == 0
            assert victim not in [s.seq for s in out.scheduled]
            # the victim is the lowest-priority (latest-arriving) of the running sequences
            assert all(s.sort_key() < victim.sort_key() for s in self.sched.running)
        sampled = self.model.execute(out)
        self.sched.update_after_step(out)
        for item in out.scheduled:
            self._record_chain(item.seq)
        for seq, token in sampled:
            assert seq.num_computed_tokens == seq.num_tokens
            seq.output_token_ids.append(token)
            if seq.num_tokens >= self.targets[seq.request_id]:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        return out

    def _record_chain(self, seq: Sequence) -> None:
        """Remember what every full computed block of `seq` must hold, keyed by its chain hash."""
        bs = self.kv.block_size
        tokens = seq.all_token_ids
        entries = expected_entries(tokens[: seq.num_computed_tokens])
        parent = None
        for i in range(seq.num_computed_tokens // bs):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            parent = hash_block(parent, list(block_tokens))
            value = (block_tokens, entries[i * bs : (i + 1) * bs])
            assert self.known.setdefault(parent, value) == value
            # the block this sequence holds at that position has the right history
            table = self.kv.block_table(seq.request_id)
            assert self.model.slots[table[i]] == value[1]

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def bookkeeping_is_sound(self):
        if not hasattr(self, "kv"):
            return
        kv, sched, pool = self.kv, self.sched, self.kv.pool
        kv.check_integrity()
        holders = [0] * kv.num_blocks
        in_tables = set()
        for table in kv.block_tables.values():
            assert len(table) == len(set(table)), "a block twice in one table"
            for block_id in table:
                holders[block_id] += 1
                in_tables.add(block_id)
        assert not in_tables & set(pool.free_queue), "a block both free and held"
        assert len(pool.free_queue) + len(in_tables) == kv.num_blocks, "a block neither free nor held"
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id]
        for block_hash, block_id in pool.cached.items():
            block = pool.blocks[block_id]
            assert block.block_hash == block_hash
            assert block_hash in self.known, "a published hash no sequence computed"
            tokens, entries = self.known[block_hash]
            assert block.token_ids == tokens
            assert self.model.slots[block_id] == entries, "a published block holds another history"
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool.cached.get(block.block_hash) == block.block_id
        if not kv.enable_prefix_caching:
            assert not pool.cached

        # queues
        assert not set(map(id, sched.running)) & set(map(id, sched.waiting))
        assert sched.running == sorted(sched.running, key=Sequence.sort_key)
        assert sched.waiting == sorted(sched.waiting, key=Sequence.sort_key)
        assert len(sched.running) <= sched.config.max_num_seqs
        assert set(kv.block_tables) == {s.request_id for s in sched.running}
        alive = {id(s) for s in sched.running + sched.waiting}
        for seq in self.seqs:
            assert seq.num_computed_tokens <= seq.num_tokens
            assert seq.num_tokens <= self.targets[seq.request_id]
            if seq.is_finished:
                assert id(seq) not in alive
                assert kv.block_table(seq.request_id) == []
            else:
                assert id(seq) in alive
        for seq in sched.waiting:
            assert seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0
        for seq in sched.running:
            assert seq.status == SequenceStatus.RUNNING
            table = kv.block_table(seq.request_id)
            assert len(table) == kv.blocks_needed(seq.num_computed_tokens), "table does not match computed tokens"
            assert seq.num_tokens - seq.num_computed_tokens >= 1
            want = expected_entries(seq.all_token_ids[: seq.num_computed_tokens])
            got = [self.model.read(table, pos) for pos in range(seq.num_computed_tokens)]
            assert got == want, f"{seq.request_id}: its blocks do not hold its history"
        if not sched.has_unfinished():
            assert kv.num_free_blocks == kv.num_blocks
            assert kv.usage == 0.0

    # ---- the end: liveness and correctness --------------------------------------------------
    def teardown(self):
        if not getattr(self, "healthy", False):
            return  # a rule already failed: report that, not a consequence of it
        unfinished = [s for s in self.seqs if not s.is_finished]
        work = sum(self.targets[s.request_id] for s in unfinished)
        bound = 4 * (len(unfinished) + 1) * (work + 1)
        steps = 0
        while self.sched.has_unfinished():
            assert steps < bound, f"no completion after {steps} steps"
            self._step()
            self.bookkeeping_is_sound()
            steps += 1
        assert self.kv.num_free_blocks == self.kv.num_blocks
        for seq in self.seqs:
            ref = reference_output(seq.prompt_token_ids, self.targets[seq.request_id])
            if seq.status == SequenceStatus.FINISHED_LENGTH:
                assert seq.output_token_ids == ref, f"{seq.request_id} generated the wrong tokens"
            else:
                assert seq.status == SequenceStatus.FINISHED_ABORTED
                assert seq.output_token_ids == ref[: len(seq.output_token_ids)]
        total = sum(s.num_preemptions for s in self.seqs)
        assert total == self.sched.num_preemptions


SchedulerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerProperties = SchedulerMachine.TestCase


# Hypothesis explores few distinct configurations per run (its examples share their first
# draws), so a plain seeded sweep over many configurations drives the same machine too.
def run_random_program(seed: int) -> SchedulerMachine:
    rng = random.Random(seed)
    m = SchedulerMachine()
    m.setup(
        num_blocks=rng.randint(1, 8),
        block_size=rng.randint(1, 4),
        max_num_seqs=rng.randint(1, 4),
        budget=rng.randint(1, 16),
        prefix_caching=rng.random() < 0.75,
        headroom=rng.randint(0, 1),
    )
    for _ in range(rng.randint(1, 40)):
        r = rng.random()
        if r < 0.35 and len(m.seqs) < MAX_ADDS:
            m.add(
                prefix=rng.randrange(len(PREFIXES)),
                cut=rng.randint(1, 12),
                suffix=[rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))],
                extra=rng.randint(1, 10),
                priority=rng.randint(0, 2),
            )
        elif r < 0.92 or all(s.is_finished for s in m.seqs):
            m.step(times=rng.randint(1, 4))
        else:
            m._abort(rng.choice([s for s in m.seqs if not s.is_finished]))
        m.bookkeeping_is_sound()
    m.teardown()
    return m


@pytest.mark.parametrize("chunk", range(4))
def test_seeded_random_programs(chunk):
    preemptions = hits = 0
    for seed in range(chunk * 250, (chunk + 1) * 250):
        m = run_random_program(seed)
        preemptions += m.sched.num_preemptions
        hits += m.kv.prefix_stats.hits
    assert preemptions > 0 and hits > 0  # the sweep does reach the interesting paths
