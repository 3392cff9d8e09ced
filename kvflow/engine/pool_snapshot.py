"""A point-in-time picture of the KV block pool, for the live dashboard and tests.

Every block is in one of four states:
  FREE     in the free queue holding nothing worth keeping (handed out first);
  CACHED   in the free queue but still holding a full prefix block (reusable until evicted);
  IN_USE   held by exactly one sequence;
  SHARED   held by several sequences at once (a common prefix, served once).
A block held by a running or waiting sequence also records which one (its index in
`requests`, plus one; 0 for none), so a viewer can colour blocks by request. The snapshot is
plain arrays, a few KB for thousands of blocks, taken between two steps on the engine's own
thread: it reads the bookkeeping, never the KV tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.sequence import Sequence

FREE, CACHED, IN_USE, SHARED = 0, 1, 2, 3
STATE_NAMES = ("free", "cached", "in_use", "shared")


@dataclass
class RequestView:
    request_id: str
    status: str  # "running" or "waiting"
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_blocks: int


@dataclass
class PoolSnapshot:
    block_size: int
    states: np.ndarray  # uint8 [num_blocks]: FREE, CACHED, IN_USE or SHARED
    owners: np.ndarray  # uint16 [num_blocks]: 1 + the index in `requests` of a holder, 0 for none
    requests: list[RequestView]

    @property
    def num_blocks(self) -> int:
        return int(self.states.shape[0])

    def counts(self) -> dict[str, int]:
        """Blocks per state, by name."""
        tally = np.bincount(self.states, minlength=len(STATE_NAMES))
        return {name: int(n) for name, n in zip(STATE_NAMES, tally)}


def take_snapshot(kv: KVCacheManager, running: list[Sequence], waiting: list[Sequence]) -> PoolSnapshot:
    """The pool as it stands; `running` and `waiting` in the scheduler's order."""
    blocks = kv.pool.blocks
    ref_cnt = np.fromiter((b.ref_cnt for b in blocks), dtype=np.int64, count=len(blocks))
    hashed = np.fromiter((b.block_hash is not None for b in blocks), dtype=bool, count=len(blocks))
    states = np.where(ref_cnt >= 2, SHARED, np.where(ref_cnt == 1, IN_USE, np.where(hashed, CACHED, FREE)))
    owners = np.zeros(len(blocks), dtype=np.uint16)
    requests: list[RequestView] = []
    for status, seqs in (("running", running), ("waiting", waiting)):
        for seq in seqs:
            table = kv.block_table(seq.request_id)
            requests.append(RequestView(seq.request_id, status, seq.num_prompt_tokens, len(seq.output_token_ids),
                                        seq.num_computed_tokens, len(table)))
            if table and len(requests) < 65535:
                ids = np.asarray(table, dtype=np.int64)
                unowned = ids[owners[ids] == 0]  # a shared block keeps its first holder's colour
                owners[unowned] = len(requests)
    return PoolSnapshot(kv.block_size, states.astype(np.uint8), owners, requests)
