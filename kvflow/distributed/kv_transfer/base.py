"""The KV connector interface: a scheduler side and a worker side, as vLLM's KV connector API splits it.

The scheduler side runs where requests are admitted (the async engine, before a request reaches
the scheduler): it decides which of a prompt's blocks should come from another instance, gets
them, and returns when the request may run. The worker side touches the KV pool itself, on the
engine thread between two steps: it reads a prompt's computed blocks out (producer) and writes
received blocks in (consumer). kvflow moves whole, full prompt blocks and hands them to the
prefix cache: a decode instance then admits the request as an ordinary prefix-cache hit, so the
scheduler, the runner and the attention kernels are unchanged, and the output is the one a
prefix-cache hit gives, which the project's invariance tests pin to the uncached output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class KVLoadResult:
    """What the scheduler side did for one request (logged, and counted at GET /kv_transfer)."""

    blocks_wanted: int = 0  # full prompt blocks not cached here
    blocks_loaded: int = 0
    bytes: int = 0
    seconds: float = 0.0  # subscription to the last block: overlaps the producer's prefill
    error: str | None = None  # why nothing (or less) came: the request computes the rest itself
    chunks: int = 0  # messages the blocks came in (one per producer step that completed blocks)
    load_seconds: float = 0.0  # consumer: writing the blocks into the pool (engine thread, between steps)


class KVConnectorScheduler(ABC):
    @abstractmethod
    async def prepare_request(self, engine: Any, token_ids: list[int], params: dict[str, Any]) -> KVLoadResult:
        """Make the request ready to run: load what the producer named in `params` has of its prompt
        into this instance's prefix cache, or give up within the timeout. Never raises for a
        producer's failure: the request then simply computes its prompt here."""


class KVConnectorWorker(ABC):
    @abstractmethod
    def save_blocks(self, engine: Any, token_ids: list[int], skip: int) -> tuple[int, bytes]:
        """Producer, engine thread: (how many leading full prompt blocks are cached, the K/V of those past `skip`)."""

    @abstractmethod
    def load_blocks(self, engine: Any, token_ids: list[int], start: int, count: int, payload: bytes) -> int:
        """Consumer, engine thread: write `count` blocks from block `start` on into free blocks and
        publish them in the prefix cache; returns how many it could place."""
