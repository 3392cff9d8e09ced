"""The engine core process: an `AsyncEngine` served over two ZMQ sockets.

`run_engine_core` is the child process's whole life. It builds the engine (loading weights and
planning the KV cache here, not in the API server), says READY with what the API server needs
to know (model path, dtype, max_model_len, sampling defaults, stats), then serves commands from
a PULL socket and answers on a PUSH socket until SHUTDOWN, or until its parent dies.

The engine side is the in-process `AsyncEngine` unchanged (its thread steps; adds, aborts and
calls are applied between two steps; `max_waiting` refuses adds; a failed step fails only its
batch), so both modes behave alike. This process adds one asyncio loop that turns each
request's stream into output deltas (`wire.OutputDeltas`) and sends everything a step produced
as one OUTPUTS message, together with the stats taken after that step: a client that sees its
request finish sees its blocks back in the pool too.

Signals: SIGINT and SIGTERM are ignored (a Ctrl-C reaches the whole process group, but it is the
API server that drains and then shuts the core down); the core dies with its parent
(PR_SET_PDEATHSIG on Linux, and a poll of the parent's pid everywhere). PR_SET_PDEATHSIG fires
when the *thread* that started the child ends, so `EngineCoreClient` must be built on a thread
that lives as long as it (the main thread, in `kvflow serve` and the tests).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import pickle
import signal
import sys
from typing import Any

import zmq
import zmq.asyncio

from kvflow.config import EngineConfig
from kvflow.entrypoints.async_engine import AsyncEngine, RequestStream
from kvflow.entrypoints.core import wire
from kvflow.distributed.kv_transfer.zmq_connector import kv_transfer_info
from kvflow.outputs import PoolingRequestOutput

logger = logging.getLogger("kvflow")
STATS_INTERVAL_S = 0.05  # idle stats refresh (aborts free blocks without any output)
PARENT_POLL_S = 0.5


def run_engine_core(config: EngineConfig, max_waiting: int | None, commands_addr: str, outputs_addr: str,
                    parent_pid: int, log_level: int = logging.INFO, kv_transfer_config: Any = None) -> None:
    """The child process's entry point (multiprocessing spawn target)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine core] %(message)s",
                        stream=sys.stderr)
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(outputs_addr)
    try:
        engine = AsyncEngine.from_config(config, max_waiting=max_waiting, kv_transfer_config=kv_transfer_config)
    except BaseException as exc:  # bad config, missing weights: the API server reports it and exits
        if isinstance(exc, (ValueError, OSError)):  # the user's to fix: the server prints the message, once
            logger.debug("the engine core failed to start", exc_info=True)
        else:  # a bug: its traceback is what tells where
            logger.exception("the engine core failed to start")
        out.send(wire.pack((wire.FAILED, *wire.encode_error(exc))))
        out.close()
        ctx.term()
        return
    out.close()  # the asyncio loop below opens its own sockets
    ctx.term()
    try:
        asyncio.run(_CoreServer(engine, commands_addr, outputs_addr, parent_pid).serve())
    finally:
        engine.shutdown()
        logger.info("engine core stopped")


def main(argv: list[str]) -> None:
    """`python -m kvflow.entrypoints.core.process START_FILE`: the start file (pickled by the client,
    in its private directory) holds `run_engine_core`'s arguments."""
    with open(argv[0], "rb") as f:
        run_engine_core(**pickle.load(f))


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class _CoreServer:
    def __init__(self, engine: AsyncEngine, commands_addr: str, outputs_addr: str, parent_pid: int) -> None:
        self.engine, self.parent_pid = engine, parent_pid
        self.commands_addr, self.outputs_addr = commands_addr, outputs_addr
        self.deltas = wire.OutputDeltas()
        self.tasks: dict[str, asyncio.Task] = {}  # request id -> the task that adds it and pumps its outputs
        self.streams: dict[str, RequestStream] = {}
        self.outbox: list[list] = []
        self.flush_scheduled = False
        self.last_stats: Any = None
        self.last_kv_info: Any = None

    async def serve(self) -> None:
        ctx = zmq.asyncio.Context()
        self.cmd_sock = ctx.socket(zmq.PULL)
        self.cmd_sock.connect(self.commands_addr)
        self.out_sock = ctx.socket(zmq.PUSH)
        self.out_sock.setsockopt(zmq.LINGER, 2000)
        self.out_sock.connect(self.outputs_addr)
        e = self.engine
        defaults = e.sampling_defaults
        await self.out_sock.send(wire.pack((wire.READY, {
            "model_path": e.model_path, "dtype": e.dtype_name, "max_model_len": e.max_model_len,
            "vocab_size": e.engine.model_config.vocab_size, "eos_token_ids": e.eos_token_ids,
            "sampling_defaults": [defaults.values, defaults.source], "tokenizer": e.engine.config.tokenizer,
            "stats": wire.encode_stats(e.get_stats()), "pid": os.getpid(), "kv_transfer": kv_transfer_info(e)})))
        watch = asyncio.ensure_future(self._watch())
        try:
            while True:
                msg = wire.unpack(await self.cmd_sock.recv())
                if msg[0] == wire.SHUTDOWN:
                    break
                self._dispatch(msg)
        finally:
            watch.cancel()
            # Requests still running end with the engine's own "shut down" error, sent before we go.
            await asyncio.to_thread(e.shutdown)
            await asyncio.sleep(0.05)
            for task in list(self.tasks.values()):
                await asyncio.wait([task], timeout=1.0)
            self._flush()
            self.out_sock.close()
            self.cmd_sock.close()
            ctx.term()

    def _dispatch(self, msg: list) -> None:
        kind = msg[0]
        if kind == wire.ADD:
            _, rid, text, ids, params, arrival, priority, kv_params, lora, salt = msg
            prompt = {"prompt": text, "prompt_token_ids": ids, **({"cache_salt": salt} if salt is not None else {})}
            self.tasks[rid] = asyncio.ensure_future(self._run_request(rid, prompt, params, arrival, priority,
                                                                      kv_params, lora))
        elif kind == wire.ABORT:
            rid = msg[1]
            stream = self.streams.get(rid)
            if stream is not None:
                stream.abort()
            elif rid in self.tasks:  # still being added: the add's own cancellation undoes it
                self.tasks[rid].cancel()
        elif kind == wire.ABORT_SAMPLE:  # a stop string ended one sample of an n > 1 request
            stream = self.streams.get(msg[1])
            if stream is not None:
                self.engine.abort_sample(msg[1], msg[2], stream)
        elif kind == wire.CALL:
            asyncio.ensure_future(self._call(msg[1], msg[2]))
        else:
            logger.error("engine core: unknown command %r", kind)

    async def _run_request(self, rid: str, prompt: dict, params: dict, arrival: float,
                           priority: int, kv_params: dict | None, lora: list | None) -> None:
        try:
            try:
                stream = await self.engine.add_request(rid, prompt, wire.decode_params(params), arrival, priority,
                                                       kv_params, wire.decode_lora(lora))
            except asyncio.CancelledError:
                return  # aborted by the client before it was added: it has forgotten the request
            except Exception as exc:
                self._send((wire.ADD_ERROR, rid, *wire.encode_error(exc)))
                return
            self.streams[rid] = stream
            self._send((wire.ADDED, rid))
            try:
                async for out in stream:
                    pooled = isinstance(out, PoolingRequestOutput)  # an embedding: its vector, once
                    self.outbox.append(wire.encode_pooled(out) if pooled else self.deltas.encode(out))
                    self._schedule_flush()
            except Exception as exc:  # EngineStepError / EngineDeadError: the request's own error
                self.outbox.append([rid, *wire.encode_error(exc)])
                self._schedule_flush()
        finally:
            self.tasks.pop(rid, None)
            self.streams.pop(rid, None)
            self.deltas.forget(rid)

    async def _call(self, call_id: int, fn_bytes: bytes) -> None:
        try:
            result = await self.engine.call(pickle.loads(fn_bytes))
            reply = (wire.CALL_RESULT, call_id, True, pickle.dumps(result))
        except Exception as exc:
            reply = (wire.CALL_RESULT, call_id, False, list(wire.encode_error(exc)))
        self._send(reply)

    def _schedule_flush(self) -> None:
        # Every stream of a step wakes in the same loop iteration: one message per step.
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if not self.outbox:
            return
        batch, self.outbox = self.outbox, []
        self.last_stats = self.engine.get_stats()
        self._send((wire.OUTPUTS, wire.encode_stats(self.last_stats), self.engine.num_step_errors, batch))

    def _send(self, msg: tuple) -> None:
        self.out_sock.send(wire.pack(msg))  # queued by zmq; the future is not awaited on purpose

    async def _watch(self) -> None:
        """Stats while idle, the engine thread's health, and the parent's life."""
        since_parent = 0.0
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            if not self.engine.is_running:
                self._flush()
                self._send((wire.DEAD, "the engine thread stopped (see the engine core's log)"))
                await asyncio.sleep(0.2)
                os._exit(1)
            stats, kv_info = self.engine.get_stats(), kv_transfer_info(self.engine)
            if stats != self.last_stats or kv_info != self.last_kv_info:
                self.last_stats, self.last_kv_info = stats, kv_info
                self._send((wire.STATS, wire.encode_stats(stats), self.engine.num_step_errors, kv_info))
            since_parent += STATS_INTERVAL_S
            if since_parent >= PARENT_POLL_S:
                since_parent = 0.0
                if os.getppid() != self.parent_pid:
                    logger.warning("engine core: the API server process is gone; exiting")
                    os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
