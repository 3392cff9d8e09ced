"""The worker side on kvflow's pool: whole prompt blocks in and out of the prefix cache.

Every function here runs on the engine thread between two steps (through `AsyncEngine.call`),
so the pool's bookkeeping and tensors are never read or written mid-step. Blocks are found by the
prefix cache's own SHA-256 chain (`engine/kv_cache_manager.hash_block`), which both instances
compute from the token ids alone, so a block's identity needs no agreement beyond the tokens.
Only full blocks before the prompt's last token move: that token's logits are sampled, so the
decode instance always computes it (as a prefix-cache hit does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvflow.engine.kv_cache_manager import hash_block
from kvflow.distributed.kv_transfer.base import KVConnectorWorker


@dataclass(frozen=True)
class KVLayout:
    """What must agree between producer and consumer for raw block bytes to mean the same K/V."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def layout_of(engine: Any) -> KVLayout:
    """The engine's block layout; a ValueError naming the setting where its blocks cannot move."""
    if engine.distributed:
        raise ValueError(f"kv_transfer_config: not supported with the distributed executor "
                         f"({engine.parallel.describe()}) yet: the KV blocks live in the worker processes")
    if engine.speculator is not None:
        raise ValueError("kv_transfer_config: not supported with speculative decoding (speculative_config) yet")
    caches = engine.runner.kv_caches
    if not caches or not isinstance(caches[0], torch.Tensor):
        raise ValueError(f"kv_transfer_config: kv_cache_dtype={engine.config.kv_cache_dtype!r} blocks cannot be "
                         "transferred yet (their scales live beside them); serve with kv_cache_dtype='auto'")
    if not engine.kv_cache_manager.enable_prefix_caching:
        raise ValueError("kv_transfer_config: needs prefix caching, which finds the blocks by their hashes; "
                         "serve without --no-enable-prefix-caching")
    _, _, block_size, kv_heads, head_dim = caches[0].shape
    return KVLayout(len(caches), block_size, kv_heads, head_dim, str(caches[0].dtype).removeprefix("torch."))


def prompt_chain(token_ids: list[int], block_size: int) -> list[tuple[bytes, list[int], bytes | None]]:
    """(hash, tokens, parent hash) of each full block before the prompt's last token."""
    out, parent = [], None
    for i in range((len(token_ids) - 1) // block_size):
        tokens = token_ids[i * block_size:(i + 1) * block_size]
        h = hash_block(parent, tokens)
        out.append((h, tokens, parent))
        parent = h
    return out


def cached_run(engine: Any, chain: list) -> list[int]:
    """Block ids of the leading run of `chain` that this engine's prefix cache holds (a producer calls
    it on the chain's unsent tail after every step: what that step completed)."""
    pool, ids = engine.kv_cache_manager.pool, []
    for h, tokens, parent in chain:
        block = pool.lookup(h, tokens, parent)
        if block is None:
            break
        ids.append(block.block_id)
    return ids


def num_cached_blocks(engine: Any, token_ids: list[int]) -> tuple[int, int]:
    """(leading prompt blocks cached here, full prompt blocks in all)."""
    chain = prompt_chain(token_ids, engine.kv_cache_manager.block_size)
    return len(cached_run(engine, chain)), len(chain)


def read_blocks(engine: Any, block_ids: list[int]) -> bytes:
    """The K/V of these pool blocks, every layer, as one frame: [layers, 2, blocks, block_size, heads, dim]."""
    index = torch.tensor(block_ids, dtype=torch.long)
    data = torch.stack([cache.index_select(1, index) for cache in engine.runner.kv_caches])  # [L, 2, n, ...]
    return data.contiguous().view(torch.uint8).numpy().tobytes()


class PoolBlocks(KVConnectorWorker):
    def save_blocks(self, engine: Any, token_ids: list[int], skip: int) -> tuple[int, bytes]:
        ids = cached_run(engine, prompt_chain(token_ids, engine.kv_cache_manager.block_size))
        if len(ids) <= skip:
            return len(ids), b""
        return len(ids), read_blocks(engine, ids[skip:])

    def load_blocks(self, engine: Any, token_ids: list[int], start: int, count: int, payload: bytes) -> int:
        kv, caches = engine.kv_cache_manager, engine.runner.kv_caches
        chain = prompt_chain(token_ids, kv.block_size)[start:start + count]
        if len(cached_run(engine, prompt_chain(token_ids, kv.block_size)[:start])) < start:
            return 0  # the blocks before these were evicted meanwhile: a chain with a hole is useless
        shape = (len(caches), *caches[0][:, :count].shape)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(caches[0].dtype).reshape(shape)
        pool, placed = kv.pool, 0
        for i, (h, tokens, parent) in enumerate(chain):
            if pool.lookup(h, tokens, parent) is not None:  # computed here meanwhile
                placed += 1
                continue
            if pool.num_free_blocks <= 1:  # never take the last free block from the running batch
                break
            block = pool.allocate()
            for layer, cache in enumerate(caches):
                cache[:, block.block_id] = data[layer, :, i]
            pool.register(block, h, tokens, parent)
            pool.release(block)  # idle and cached: the request's admission takes it as a prefix hit
            placed += 1
        return placed
