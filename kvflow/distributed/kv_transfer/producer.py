"""The producer's block server: a prompt's K/V sent to a consumer as the prefill computes it.

A consumer subscribes to a prompt (its token ids, the leading blocks it already has, its block
layout) on a ROUTER socket served by this module's own thread and event loop, so it never waits
on the API server's. From then on, after every engine step (`AsyncEngine.add_step_listener`, on
the engine thread, so the pool is read between two steps), the subscription's next full prompt
blocks that the prefix cache now holds are read out and sent as one frame: a long prompt that
chunked prefill computes over several steps (`max_num_batched_tokens`) streams while its later
chunks are still being computed. A last "done" message follows the prompt's last full block.

The prompt's blocks appear because the router sends the same prompt here (with max_tokens=1) at
the same time as it sends the request to the decode instance; blocks that were cached already
(an earlier request) go at once. Every `HEARTBEAT_S` a pending subscription hears "wait", so the
consumer can tell a slow prefill from a dead producer; one whose prompt no request here is
computing for `GRACE_S` (the prefill failed, or never came) is told so with an error, and the
consumer computes the prompt itself.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvflow.distributed.kv_transfer.base import KVLoadResult
from kvflow.distributed.kv_transfer.blocks import cached_run, layout_of, prompt_chain, read_blocks
from kvflow.distributed.kv_transfer.config import KVTransferConfig
from kvflow.distributed.kv_transfer.stats import TransferStats

logger = logging.getLogger("kvflow")
HEARTBEAT_S = 0.25
GRACE_S = 2.0  # a subscription whose prompt nobody here computes for this long is refused


@dataclass(eq=False)
class _Subscription:
    ident: bytes  # the consumer's DEALER socket (one per request)
    token_ids: list[int]
    chain: list  # prompt_chain(token_ids): the full blocks before the last token
    sent: int  # blocks of the chain the consumer has (it had them, or they were sent)
    last_live: float  # monotonic: when blocks last went out or a request here last held the prompt
    started: float  # perf_counter at subscription
    blocks: int = 0  # sent
    bytes: int = 0
    chunks: int = 0


def _computing(engine: Any, token_ids: list[int]) -> bool:
    """Whether a request on this engine (waiting or running) has this prompt."""
    n = len(token_ids)
    for seq in (*engine.scheduler.waiting, *engine.scheduler.running):
        if seq.num_prompt_tokens == n and seq.prompt_token_ids == token_ids:
            return True
    return False


class ZmqKVServer:
    """The producer's side: streams the prompt blocks of `engine` (an AsyncEngine) over TCP."""

    def __init__(self, engine: Any, config: KVTransferConfig) -> None:
        self.engine, self.config = engine, config
        self.stats = TransferStats()
        self.layout = layout_of(engine.engine)  # ValueError where this engine's blocks cannot move
        self._subs: dict[bytes, _Subscription] = {}
        self._lock = threading.Lock()  # the subscriptions: the server loop adds and expires, the engine thread sends
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
        engine.add_step_listener(self._advance_all)
        logger.info("KV transfer: producer streaming prompt blocks on %s", self.address)

    # ---- the server loop -------------------------------------------------------------------
    async def _serve(self) -> None:
        asyncio.ensure_future(self._tick())
        while True:
            ident, _, raw = await self._sock.recv_multipart()
            asyncio.ensure_future(self._subscribe(ident, raw))

    async def _subscribe(self, ident: bytes, raw: bytes) -> None:
        try:
            req = msgpack.unpackb(raw)
            if req.get("layout") != self.layout.to_dict():
                raise ValueError(f"KV layouts differ: producer {self.layout.to_dict()}, consumer {req.get('layout')}")
            token_ids = [int(t) for t in req["token_ids"]]
            chain = prompt_chain(token_ids, self.layout.block_size)
            sub = _Subscription(ident, token_ids, chain, int(req["skip"]), time.monotonic(), time.perf_counter())
            with self._lock:
                self._subs[ident] = sub
            await self.engine.call(self._advance_all)  # what is cached already goes now, busy or idle
        except Exception as exc:
            with self._lock:
                self._subs.pop(ident, None)
            self.stats.failures += 1
            self._send(ident, {"kind": "error", "error": f"{type(exc).__name__}: {exc}"})

    async def _tick(self) -> None:
        """Heartbeats, and the liveness check a subscription gets even while no step runs."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            with self._lock:
                if not self._subs:
                    continue
            try:
                await self.engine.call(self._advance_all)
            except Exception as exc:  # the engine is gone: nothing more will come
                self._expire(lambda s: True, f"the producer's engine stopped: {exc}")
                continue
            now = time.monotonic()
            self._expire(lambda s: now - s.last_live > GRACE_S,
                         f"no request on this producer computes the prompt (for {GRACE_S:g} s): its prefill "
                         "failed or never came")
            with self._lock:
                idents = list(self._subs)
            for ident in idents:
                self._send(ident, {"kind": "wait"})

    def _expire(self, which: Any, error: str) -> None:
        with self._lock:
            gone = [s for s in self._subs.values() if which(s)]
            for s in gone:
                del self._subs[s.ident]
        for s in gone:
            self.stats.failures += 1
            self._send(s.ident, {"kind": "error", "error": error})

    def _send(self, ident: bytes, header: dict, payload: bytes = b"") -> None:
        """From any thread: queue one message to a consumer on the server loop."""
        def send() -> None:
            asyncio.ensure_future(self._sock.send_multipart([ident, b"", msgpack.packb(header), payload], copy=False))

        try:
            self._loop.call_soon_threadsafe(send)
        except RuntimeError:  # the loop is closed (shutting down)
            pass

    # ---- the engine thread -----------------------------------------------------------------
    def _advance_all(self, engine: Any) -> None:
        """After a step (or on a call between steps): send each subscription what is newly cached."""
        with self._lock:
            subs = list(self._subs.values())
        now = time.monotonic()
        for sub in subs:
            ids = cached_run(engine, sub.chain[sub.sent:])
            if ids:
                payload = read_blocks(engine, ids)
                self._send(sub.ident, {"kind": "blocks", "start": sub.sent, "count": len(ids)}, payload)
                sub.sent += len(ids)
                sub.blocks += len(ids)
                sub.bytes += len(payload)
                sub.chunks += 1
                sub.last_live = now
            elif _computing(engine, sub.token_ids):
                sub.last_live = now
            if sub.sent >= len(sub.chain):
                with self._lock:
                    if self._subs.pop(sub.ident, None) is None:
                        continue  # expired meanwhile: it was told
                self._send(sub.ident, {"kind": "done", "chunks": sub.chunks})
                self.stats.record(KVLoadResult(sub.blocks, sub.blocks, sub.bytes, time.perf_counter() - sub.started,
                                               chunks=sub.chunks))
