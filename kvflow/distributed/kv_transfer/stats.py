"""The transfer counters each side keeps, answered at GET /kv_transfer (and read by `kvflow bench router`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.distributed.kv_transfer.base import KVLoadResult


@dataclass
class TransferStats:
    requests: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0  # per request: from the subscription to the last block (overlapping the prefill)
    load_seconds: float = 0.0
    chunks: int = 0
    failures: int = 0

    def record(self, result: KVLoadResult) -> None:
        self.requests += 1
        self.blocks += result.blocks_loaded
        self.bytes += result.bytes
        self.seconds += result.seconds
        self.load_seconds += result.load_seconds
        self.chunks += result.chunks
        self.failures += result.error is not None
