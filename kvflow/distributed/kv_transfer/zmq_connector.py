"""The KV connector over ZMQ/TCP: a producer's block server and a consumer's fetch.

Producer (`ZmqKVServer`): a ROUTER socket on `kv_host:kv_port`, served by its own thread and
event loop so that it never waits on the API server's. A request names a prompt (its token ids),
the number of leading blocks the consumer already has, and the consumer's block layout; the
reply is a msgpack header and one frame with the K/V of the blocks the producer's prefix cache
still holds past those, read between two steps. The prompt's blocks are there because the
router sent the same prompt to the producer first (with max_tokens=1), and they stay until
the LRU evicts them.

Consumer (`ZmqKVConnector.prepare_request`): counts the prompt's blocks cached here, asks the
producer for the rest with a DEALER socket, writes what came into free blocks and publishes them
in the prefix cache, all before the request is added; past `kv_timeout_s`, or on any error, it
gives up and the request computes its prompt itself. Blocks move after the producer's whole
prefill, not layer by layer as they are produced: the router only calls the decode instance once
the prefill answered.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvflow.distributed.kv_transfer.base import KVConnectorScheduler, KVLoadResult
from kvflow.distributed.kv_transfer.blocks import PoolBlocks, layout_of, num_cached_blocks
from kvflow.distributed.kv_transfer.config import KVTransferConfig

logger = logging.getLogger("kvflow")
_worker = PoolBlocks()


@dataclass
class TransferStats:
    requests: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0

    def record(self, result: KVLoadResult) -> None:
        self.requests += 1
        self.blocks += result.blocks_loaded
        self.bytes += result.bytes
        self.seconds += result.seconds
        self.failures += result.error is not None


class ZmqKVServer:
    """The producer's side: serves cached prompt blocks of `engine` (an AsyncEngine) over TCP."""

    def __init__(self, engine: Any, config: KVTransferConfig) -> None:
        self.engine, self.config = engine, config
        self.stats = TransferStats()
        self.layout = layout_of(engine.engine)
        if self.layout is None:
            raise ValueError("kv_transfer_config: this engine's KV blocks cannot be transferred (int8 KV cache, "
                             "speculative decoding or prefix caching off)")
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if config.kv_port:
            self._sock.bind(f"tcp://{config.kv_host}:{config.kv_port}")
            port = config.kv_port
        else:
            port = self._sock.bind_to_random_port(f"tcp://{config.kv_host}")
        self.address = f"tcp://{config.kv_host}:{port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),),
                                        name="kvflow-kv-server", daemon=True)
        self._thread.start()
        logger.info("KV transfer: producer serving prompt blocks on %s", self.address)

    async def _serve(self) -> None:
        while True:
            ident, _, raw = await self._sock.recv_multipart()
            asyncio.ensure_future(self._answer(ident, raw))

    async def _answer(self, ident: bytes, raw: bytes) -> None:
        start = time.perf_counter()
        try:
            req = msgpack.unpackb(raw)
            if req.get("layout") != self.layout.to_dict():
                raise ValueError(f"KV layouts differ: producer {self.layout.to_dict()}, consumer {req.get('layout')}")
            found, payload = await self.engine.call(functools.partial(
                _worker.save_blocks, token_ids=req["token_ids"], skip=req["skip"]))
            header = {"found": found, "start": req["skip"], "count": max(0, found - req["skip"])}
            self.stats.record(KVLoadResult(header["count"], header["count"], len(payload),
                                           time.perf_counter() - start))
        except Exception as exc:
            header, payload = {"error": f"{type(exc).__name__}: {exc}"}, b""
            self.stats.failures += 1
        await self._sock.send_multipart([ident, b"", msgpack.packb(header), payload], copy=False)


class ZmqKVConnector(KVConnectorScheduler):
    """The consumer's side (see the module docstring)."""

    def __init__(self, engine: Any, config: KVTransferConfig) -> None:
        self.config = config
        self.stats = TransferStats()
        self.layout = layout_of(engine.engine)
        if self.layout is None:
            raise ValueError("kv_transfer_config: this engine's KV blocks cannot be transferred (int8 KV cache, "
                             "speculative decoding or prefix caching off)")

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
                header, payload = await asyncio.wait_for(self._fetch(addr, token_ids, have), self.config.kv_timeout_s)
                if "error" in header:
                    raise RuntimeError(f"the producer refused: {header['error']}")
                if header["count"]:
                    result.bytes = len(payload)
                    result.blocks_loaded = await engine.call(functools.partial(
                        _worker.load_blocks, token_ids=token_ids, start=header["start"], count=header["count"],
                        payload=payload))
        except asyncio.TimeoutError:
            result.error = f"no answer from the producer within {self.config.kv_timeout_s:g} s"
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        result.seconds = time.perf_counter() - start
        if result.error:
            logger.warning("KV transfer failed (%s); the request computes its prompt here", result.error)
        self.stats.record(result)
        return result

    async def _fetch(self, addr: str, token_ids: list[int], skip: int) -> tuple[dict, bytes]:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(addr)
            await sock.send_multipart([b"", msgpack.packb({"token_ids": token_ids, "skip": skip,
                                                           "layout": self.layout.to_dict()})])
            _, header, payload = await sock.recv_multipart(copy=True)
            return msgpack.unpackb(header), payload
        finally:
            sock.close()


def make_connector(engine: Any, config: KVTransferConfig) -> ZmqKVServer | ZmqKVConnector:
    """The role's half, for an AsyncEngine (in the API server's process or in the engine core)."""
    return ZmqKVServer(engine, config) if config.is_producer else ZmqKVConnector(engine, config)


async def prepare_kv_transfer(engine: Any, prompt: Any, params: dict[str, Any]) -> None:
    """An AsyncEngine's check and load for a request's `kv_transfer_params` (vLLM's field), before the add.

    `do_remote_decode` (sent to a producer) needs nothing more: the prompt's blocks stay in its
    prefix cache. `do_remote_prefill` with `remote_kv_addr` (sent to a consumer) loads them first.
    """
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    connector = getattr(engine, "kv_connector", None)
    if params.get("do_remote_decode"):
        if not isinstance(connector, ZmqKVServer):
            raise ValueError("kv_transfer_params.do_remote_decode: this instance is not a kv_producer "
                             "(start it with --kv-transfer-config '{\"kv_role\": \"kv_producer\"}')")
    if params.get("do_remote_prefill"):
        if not isinstance(connector, ZmqKVConnector):
            raise ValueError("kv_transfer_params.do_remote_prefill: this instance is not a kv_consumer "
                             "(start it with --kv-transfer-config '{\"kv_role\": \"kv_consumer\"}')")
        _, ids = engine.engine.tokenize(prompt)
        await connector.prepare_request(engine, ids, params)


def kv_transfer_info(engine: Any) -> dict[str, Any] | None:
    """GET /kv_transfer: the role, the producer's address, the transfer counters."""
    connector = getattr(engine, "kv_connector", None)
    if connector is None:
        return None
    return {"kv_role": connector.config.kv_role, "kv_addr": getattr(connector, "address", None),
            "stats": vars(connector.stats).copy()}
