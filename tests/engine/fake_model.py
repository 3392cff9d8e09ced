"""A simulated model for scheduler tests (no weights, no tensors).

The fake model mimics what matters about a real one: it writes one K/V "entry" per computed
token into the block table's slots, each entry derived from the entry of the previous
position *as read back from the cache* and the token itself, and it samples the next token
from the last entry (modulo the vocabulary size). A sequence is therefore only generated
correctly if every block the scheduler and the prefix cache handed it holds the right
history; recomputation after a preemption gives the same tokens, and anything served wrongly
from the cache changes them. Writing into a block anyone else can see (shared, or published
in the prefix cache) and reading a position before it was written are caught on the spot.
"""

from __future__ import annotations

from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.scheduler import SchedulerOutput
from kvflow.engine.sequence import Sequence, SequenceStatus

_MOD = (1 << 61) - 1
_SEED = 0x9E3779B97F4A7C15 % _MOD


def kv_entry(prev: int, token: int, pos: int) -> int:
    return (prev * 1_000_003 + token * 7919 + pos + 1) % _MOD


def expected_entries(tokens: list[int]) -> list[int]:
    """The K/V entries an uncached model computes for `tokens`, position by position."""
    out, prev = [], _SEED
    for pos, token in enumerate(tokens):
        prev = kv_entry(prev, token, pos)
        out.append(prev)
    return out


def reference_output(prompt: list[int], target_len: int, vocab: int) -> list[int]:
    """What the fake model generates for `prompt` without any cache: the ground truth."""
    tokens, prev, pos = list(prompt), _SEED, 0
    while pos < len(tokens):
        prev = kv_entry(prev, tokens[pos], pos)
        if pos == len(tokens) - 1 and len(tokens) < target_len:
            tokens.append(prev % vocab)
        pos += 1
    return tokens[len(prompt) :]


class FakeModel:
    def __init__(self, kv: KVCacheManager, vocab: int) -> None:
        self.kv = kv
        self.vocab = vocab
        self.slots: dict[int, list[int | None]] = {}  # block id -> one entry per slot

    def read(self, table: list[int], pos: int) -> int | None:
        """The entry at `pos` of the sequence with block table `table`; None if never written."""
        slots = self.slots.get(table[pos // self.kv.block_size])
        return None if slots is None else slots[pos % self.kv.block_size]

    def execute(self, out: SchedulerOutput) -> list[tuple[Sequence, int]]:
        """Compute every scheduled chunk; return (seq, token) for the rows that complete."""
        bs, sampled = self.kv.block_size, []
        for item in out.scheduled:
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            assert seq.status == SequenceStatus.RUNNING
            assert item.num_new_tokens >= 1 and end <= seq.num_tokens
            table = self.kv.block_table(seq.request_id)
            assert len(table) >= self.kv.blocks_needed(end), "block table does not cover the chunk"
            prev = _SEED if start == 0 else self.read(table, start - 1)
            assert prev is not None, f"position {start - 1} read before it was written"
            for pos, token in enumerate(seq.token_slice(start, end), start):
                block = self.kv.pool.blocks[table[pos // bs]]
                # a block anyone else can see (shared, or published in the prefix cache) is never written
                assert block.ref_cnt == 1 and block.block_hash is None, f"write into shared block {block}"
                prev = kv_entry(prev, token, pos)
                self.slots.setdefault(block.block_id, [None] * bs)[pos % bs] = prev
            if item.is_sampled:
                sampled.append((seq, prev % self.vocab))
        return sampled
