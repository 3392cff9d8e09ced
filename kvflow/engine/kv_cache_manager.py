"""The KV cache as a managed resource: block pool, block tables and prefix hashes.

The pool holds `num_blocks` fixed-size blocks (the tensors themselves live in the model
runner; this module only does the bookkeeping). Each sequence owns a block table: the list
of block ids holding its tokens in order.

Prefix caching: once a block is full, it is keyed by a hash chained from its parent
block's hash and its own token ids. A new request walks its prompt's chain and reuses every
block already cached, so only the rest is computed. Blocks are reference counted; a block
nobody holds goes to the back of an LRU free queue but keeps its contents and hash, and is
evicted only when the front of the queue is handed out for new tokens. A hit is confirmed
against the block's stored tokens and its parent's hash, so serving wrong K/V would need a
SHA-256 collision on the chain, not merely two equal blocks after different prefixes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvflow.engine.sequence import Sequence


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens the hash stands for (collision check)
    parent_hash: bytes | None = None  # the previous block's chain hash (collision check)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """A block's chain hash: its parent's, or for a first block the sequence's `hash_root` (None for
    the base model's K/V), then its token ids."""
    digest = hashlib.sha256(parent_hash or b"kvflow")
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


def chain_root(lora_key: str | None = None, cache_salt: str | None = None) -> bytes | None:
    """The root of a sequence's hash chain: None (the base model's K/V, unsalted) unless it runs a
    LoRA adapter (`lora_key` names it: id and folder, so an id reused for another folder finds
    none of the old one's blocks) or carries a cache_salt, whose blocks only requests with the
    same salt may find. Each part is length-prefixed, so no two (adapter, salt) pairs share a root."""
    if lora_key is None and cache_salt is None:
        return None
    root = b"kvflow"
    for tag, part in ((b"lora", lora_key), (b"salt", cache_salt)):
        if part is not None:
            data = part.encode()
            root += b"/%s:%d:%s" % (tag, len(data), data)
    return root


class BlockPool:
    """Blocks, their reference counts, the LRU free queue and the hash -> block index."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> KVBlock:
        """Hand out the least recently freed block, evicting its cached contents."""
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids, block.parent_hash = None, None, None
        block.ref_cnt = 1
        return block

    def touch(self, block: KVBlock) -> None:
        """Take a reference to a cached block, pulling it out of the free queue if idle."""
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def release(self, block: KVBlock) -> None:
        block.ref_cnt -= 1
        assert block.ref_cnt >= 0, f"block {block.block_id} released more often than taken"
        if block.ref_cnt == 0:
            self.free_queue[block.block_id] = None
            if block.block_hash is None:  # nothing worth keeping: reuse it first
                self.free_queue.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: bytes, token_ids: list[int], parent_hash: bytes | None) -> KVBlock | None:
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(token_ids) or block.parent_hash != parent_hash:
            return None  # a collision: same hash, other contents or another prefix
        return block

    def register(self, block: KVBlock, block_hash: bytes, token_ids: list[int], parent_hash: bytes | None) -> None:
        if block.block_hash is not None or block_hash in self.cached:
            return  # already cached, or another block holds the same tokens
        block.block_hash, block.token_ids, block.parent_hash = block_hash, tuple(token_ids), parent_hash
        self.cached[block_hash] = block.block_id


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # chain hashes of each sequence's full blocks
        self.prefix_stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (idle cached blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------
    def _chain_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(seq.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else seq.hash_root, seq.token_slice(i * bs, (i + 1) * bs)))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """The longest run of cached blocks covering the start of the sequence.

        Only whole blocks within `seq.num_prefix_cacheable_tokens`: never the last token
        (its logits are sampled), nor prompt positions whose prompt logprobs are still due.
        """
        max_blocks = seq.num_prefix_cacheable_tokens // self.block_size
        bs, hits = self.block_size, []
        if self.enable_prefix_caching:
            hashes = self._chain_hashes(seq, max_blocks)
            for i, h in enumerate(hashes[:max_blocks]):
                block = self.pool.lookup(h, seq.token_slice(i * bs, (i + 1) * bs), hashes[i - 1] if i else None)
                if block is None:
                    break
                hits.append(block)
        shared = self._sibling_prompt_blocks(seq, max_blocks)
        return shared if len(shared) > len(hits) else hits

    def _sibling_prompt_blocks(self, seq: Sequence, max_blocks: int) -> list[KVBlock]:
        """The longest run of full prompt blocks another sample of the same request holds, computed.

        Parallel samples share one prompt, so these blocks hold exactly this sequence's K/V; taking
        them by reference is what shares the prompt when the prefix cache is off (or evicted it).
        Only whole blocks inside the prompt: nobody writes to them again, so sharing needs no copy.
        """
        limit = min(max_blocks, seq.num_prompt_tokens // self.block_size)
        best: list[int] = []
        for other in seq.siblings:
            table = self.block_tables.get(other.request_id) if other is not seq else None
            if table:
                k = min(limit, other.num_computed_tokens // self.block_size, len(table))
                if k > len(best):
                    best = table[:k]
        return [self.pool.blocks[b] for b in best]

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += num_prompt_tokens
        self.prefix_stats.hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks this sequence has completely computed so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(seq.request_id, [])
        # A sequence that stopped inside an accepted speculative run has K/V past its last kept token.
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(table))
        hashes = self._chain_hashes(seq, num_full)
        bs = self.block_size
        for i in range(num_full):
            block = self.pool.blocks[table[i]]
            if block.block_hash is None:
                self.pool.register(block, hashes[i], seq.token_slice(i * bs, (i + 1) * bs), hashes[i - 1] if i else None)

    # ---- allocation ------------------------------------------------------------------
    def num_blocks_to_take(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] | None = None) -> int:
        """Blocks the free queue would lose: fresh ones plus idle cached ones pulled out of it."""
        cached = cached or []
        table = self.block_tables.get(seq.request_id, [])
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        new = max(0, total - len(table) - len(cached))
        return new + sum(1 for b in cached if b.ref_cnt == 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] | None = None) -> bool:
        return self.num_blocks_to_take(seq, num_new_tokens, cached) <= self.pool.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] | None = None) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens (after taking `cached` prefix blocks).

        All or nothing: returns False, changing nothing, when the pool cannot cover it.
        """
        if not self.can_allocate(seq, num_new_tokens, cached):
            return False
        table = self.block_tables.setdefault(seq.request_id, [])
        for block in cached or []:
            self.pool.touch(block)
            table.append(block.block_id)
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        while len(table) < total:
            table.append(self.pool.allocate().block_id)
        return True

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past the sequence's computed tokens (a rejected draft tail's)."""
        table = self.block_tables.get(seq.request_id)
        if table is None:
            return
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(table) > keep:
            self.pool.release(self.pool.blocks[table.pop()])

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks; tail blocks are released first so they are evicted first."""
        table = self.block_tables.pop(seq.request_id, [])
        for block_id in reversed(table):
            self.pool.release(self.pool.blocks[block_id])
        self._hashes.pop(seq.request_id, None)

    # ---- invariants ------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (used by tests)."""
        holders = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                holders[block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {holders[block.block_id]} tables"
            )
            in_free = block.block_id in self.pool.free_queue
            assert in_free == (block.ref_cnt == 0), f"block {block.block_id}: free={in_free}, ref_cnt={block.ref_cnt}"
        for block_hash, block_id in self.pool.cached.items():
            block = self.pool.blocks[block_id]
            assert block.block_hash == block_hash, f"cached index points at block {block_id} holding another hash"
            assert block.token_ids is not None and len(block.token_ids) == self.block_size
