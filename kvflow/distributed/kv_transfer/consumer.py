"""The consumer's side: a request's prompt blocks received from the producer as they are computed.

`ZmqKVConnector.prepare_request` runs before the request is added (the scheduler side of the
connector): it counts the prompt's full blocks cached here, subscribes to the rest at the
producer named in `remote_kv_addr` (`producer.ZmqKVServer`) with a DEALER socket, and writes each
frame that arrives into free blocks published in the prefix cache (`blocks.PoolBlocks.load_blocks`,
on the engine thread between two of its steps, so decode streams running here go on), until the
producer says "done". Admission then takes them as prefix-cache hits.

It gives up, keeping whatever arrived, when the producer refuses (its prefill failed or never
came), when it is silent for `SILENCE_S` (no heartbeat: it is gone), or after `kv_timeout_s` in
all; the request then computes the rest of its prompt here. It never raises for a producer's
failure.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvflow.distributed.kv_transfer.base import KVConnectorScheduler, KVLoadResult
from kvflow.distributed.kv_transfer.blocks import PoolBlocks, layout_of, num_cached_blocks
from kvflow.distributed.kv_transfer.config import KVTransferConfig
from kvflow.distributed.kv_transfer.stats import TransferStats

logger = logging.getLogger("kvflow")
SILENCE_S = 2.0  # the producer heartbeats every producer.HEARTBEAT_S; this much silence means it is gone
_worker = PoolBlocks()


class ZmqKVConnector(KVConnectorScheduler):
    """The consumer's side (see the module docstring)."""

    def __init__(self, engine: Any, config: KVTransferConfig) -> None:
        self.config = config
        self.stats = TransferStats()
        self.layout = layout_of(engine.engine)  # ValueError where this engine's blocks cannot move

    async def prepare_request(self, engine: Any, token_ids: list[int], params: dict[str, Any]) -> KVLoadResult:
        start = time.perf_counter()
        result = KVLoadResult()
        try:
            addr = params.get("remote_kv_addr")
            if not isinstance(addr, str) or not addr.startswith("tcp://"):
                raise ValueError(f"kv_transfer_params.remote_kv_addr must be a tcp:// address, got {addr!r}")
            have, total = await engine.call(functools.partial(num_cached_blocks, token_ids=token_ids))
            result.blocks_wanted = total - have
            if result.blocks_wanted > 0:
                await asyncio.wait_for(self._receive(engine, addr, token_ids, have, result), self.config.kv_timeout_s)
        except asyncio.TimeoutError:
            result.error = f"the prompt's blocks did not all come within {self.config.kv_timeout_s:g} s"
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        result.seconds = time.perf_counter() - start
        if result.error:
            logger.warning("KV transfer incomplete (%s; %d of %d blocks came); the request computes the rest here",
                           result.error, result.blocks_loaded, result.blocks_wanted)
        self.stats.record(result)
        return result

    async def _receive(self, engine: Any, addr: str, token_ids: list[int], skip: int, result: KVLoadResult) -> None:
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(addr)
            await sock.send_multipart([b"", msgpack.packb({"token_ids": token_ids, "skip": skip,
                                                           "layout": self.layout.to_dict()})])
            while True:
                if not await sock.poll(SILENCE_S * 1000):
                    raise TimeoutError(f"the producer at {addr} was silent for {SILENCE_S:g} s")
                _, raw, payload = await sock.recv_multipart(copy=True)
                header = msgpack.unpackb(raw)
                kind = header.get("kind")
                if kind == "done":
                    return
                if kind == "error":
                    raise RuntimeError(f"the producer refused: {header['error']}")
                if kind == "blocks":
                    began = time.perf_counter()
                    result.blocks_loaded += await engine.call(functools.partial(
                        _worker.load_blocks, token_ids=token_ids, start=header["start"], count=header["count"],
                        payload=payload))
                    result.load_seconds += time.perf_counter() - began
                    result.bytes += len(payload)
                    result.chunks += 1
        finally:
            sock.close()
