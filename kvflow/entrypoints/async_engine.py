"""`LLMEngine` behind asyncio: one engine thread steps, coroutines submit and stream.

The engine is not thread-safe, and a forward pass blocks for milliseconds to seconds, so it
cannot run on the event loop. `AsyncEngine` owns one dedicated thread that is the only code
ever touching the engine: the asyncio side never calls the engine, it appends *commands*
(add, abort) to a locked list and wakes the thread. Before each step the thread applies all
pending commands (so an abort frees its KV blocks before the next batch is scheduled), runs
one step, and hands each request's new output to that request's `asyncio.Queue` with
`loop.call_soon_threadsafe` (one call per step and loop, not one per token). With no work
the thread sleeps on a condition variable instead of spinning.

A step that raises fails the requests it was running (their streams raise
`EngineStepError`), aborts them so their blocks return to the pool, and the loop goes on
serving everyone else: one bad batch must not take the server down.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvflow.config import EngineConfig
from kvflow.engine.cpu_threads import release_openmp_threads, set_compute_threads
from kvflow.engine.inputs import cache_salt_of
from kvflow.engine.llm_engine import LLMEngine, PromptInput
from kvflow.engine.request_state import EngineStats
# The request-side pieces live in request_stream.py (shared with the split server's client); the
# names stay importable from here.
from kvflow.entrypoints.request_stream import (EngineDeadError, EngineOverloadedError, EngineStepError,  # noqa: F401
                                               RequestStream, _put_all, _resolve)
from kvflow.loader.generation_config import SamplingDefaults
from kvflow.lora.request import LoRARequest
from kvflow.outputs import RequestOutput
from kvflow.pooling.params import PoolingParams
from kvflow.sampling.params import SamplingParams

logger = logging.getLogger("kvflow")


@dataclass
class _AddCommand:
    request_id: str
    prompt: PromptInput
    params: SamplingParams | PoolingParams
    arrival_time: float
    priority: int
    stream: RequestStream
    future: asyncio.Future
    lora_request: LoRARequest | None = None


@dataclass
class _CallCommand:
    """Run `fn(engine)` on the engine thread between two steps (a consistent read of its state)."""

    fn: Any
    future: asyncio.Future


@dataclass
class _AbortCommand:
    request_id: str
    stream: "RequestStream | None" = None  # when set, abort only if the id still belongs to this stream
    sample: int | None = None  # n > 1: stop only this sample; the request goes on


class AsyncEngine:
    """Runs an `LLMEngine` on its own thread and serves many concurrent asyncio callers.

    `max_waiting` bounds the requests waiting for a batch slot (the waiting queue beyond the free
    slots): a request that would make them more is refused with `EngineOverloadedError` (HTTP 503 + Retry-After) instead of queueing
    without limit while every client times out.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None, kv_transfer_config: Any = None) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.num_step_errors = 0
        self._cond = threading.Condition()
        self._commands: list[_AddCommand | _AbortCommand | _CallCommand] = []
        self._closed = False  # set under _cond once the thread stops taking commands
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stats: EngineStats = engine.get_stats()
        self._stopping = False
        self._dead: BaseException | None = None
        self._step_listeners: list[Any] = []  # fn(engine) after every step, on the engine thread
        # This thread built the engine (loading, the warm-up pass) and computes no more: its OpenMP
        # workers would otherwise slow every parallel region of the engine thread (cpu_threads.py).
        release_openmp_threads()
        self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)
        self._thread.start()
        self.kv_connector = None  # prefill/decode disaggregation (kvflow/distributed/kv_transfer/), with --kv-transfer-config
        if kv_transfer_config is not None:
            from kvflow.distributed.kv_transfer.zmq_connector import make_connector

            self.kv_connector = make_connector(self, kv_transfer_config)

    @classmethod
    def from_config(cls, config: EngineConfig, max_waiting: int | None = None,
                    kv_transfer_config: Any = None) -> "AsyncEngine":
        return cls(LLMEngine(config), max_waiting=max_waiting, kv_transfer_config=kv_transfer_config)

    # ---- read-only views (safe from any thread: set once at start-up) ------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        return self.engine.eos_token_ids

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The model's defaults for the sampling fields a request leaves unset (generation_config)."""
        return self.engine.sampling_defaults

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def dtype_name(self) -> str:
        return str(self.engine.dtype).removeprefix("torch.")

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopping

    def get_stats(self) -> EngineStats:
        """The snapshot the engine thread took after its last step (never touches the engine)."""
        return self._stats

    # ---- the asyncio side ------------------------------------------------------------------
    async def call(self, fn: Any) -> Any:
        """`fn(engine)` run on the engine thread before its next step, and its result: how a
        reader (the dashboard's pool snapshot) sees the engine's state whole, never mid-step."""
        self._check_alive()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._submit(_CallCommand(fn, future))
        return await future

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Submit a request; returns its output stream once the engine accepted it.

        `kv_transfer_params` (prefill/decode disaggregation) may load the prompt's KV from a producer.
        Raises what `LLMEngine.add_request` raises (ValueError for a bad prompt or id,
        `StructuredOutputError` for a constraint that does not compile),
        `EngineOverloadedError` when the waiting queue is full, `EngineDeadError` after shutdown.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # Compile on a worker thread (xgrammar compiles in C++, not holding the GIL throughout), so
            # the engine thread keeps stepping; its add_request then finds the grammar cached.
            await loop.run_in_executor(None, self.engine.compile_structured_output, params)
        if kv_transfer_params is not None and (lora_request is not None or cache_salt_of(prompt) is not None):
            # The instances would key the blocks apart (adapter, salt) and the consumer would wait for
            # nothing. A producer refuses (the router logs it); a consumer computes the prompt itself,
            # as when a prefill fails, so the client still gets its answer.
            if not kv_transfer_params.get("do_remote_prefill"):
                raise ValueError("kv_transfer_params: not with a LoRA adapter or a cache_salt yet")
            logger.info("request %s: a LoRA adapter or cache_salt; computing its prompt here instead of "
                        "loading it from the prefill instance", request_id)
            kv_transfer_params = None
        if kv_transfer_params is not None:  # a consumer loads the prompt's blocks from the producer first
            from kvflow.distributed.kv_transfer.zmq_connector import prepare_kv_transfer

            await prepare_kv_transfer(self, prompt, kv_transfer_params)
        stream = RequestStream(request_id, self, loop)
        future: asyncio.Future = loop.create_future()
        cmd = _AddCommand(request_id, prompt, params or SamplingParams(), arrival_time or time.time(), priority, stream,
                          future, lora_request)
        self._submit(cmd)
        try:
            await future
        except asyncio.CancelledError:
            self.abort(request_id, stream)  # queued after the add: undoes it only if this add went through
            raise
        return stream

    def abort(self, request_id: str, stream: RequestStream | None = None) -> None:
        """Abort a request (thread-safe, returns at once; applied before the engine's next step).

        With `stream`, the abort applies only while the id still belongs to that stream, so a late
        abort can never hit a newer request that reuses the id.
        """
        with self._cond:
            if not self._closed:
                self._commands.append(_AbortCommand(request_id, stream))
                self._cond.notify()

    def add_step_listener(self, fn: Any) -> None:
        """Call `fn(engine)` on the engine thread after every step, before the next: how a KV producer
        sends each prefill chunk's blocks as soon as they are computed. Its exceptions are logged."""
        self._step_listeners.append(fn)

    def abort_sample(self, request_id: str, index: int, stream: RequestStream) -> None:
        """Stop sample `index` of a request with n > 1 (its blocks freed before the next step), while
        its other samples go on: what the split server's API process asks when a stop string ends one."""
        with self._cond:
            if not self._closed:
                self._commands.append(_AbortCommand(request_id, stream, index))
                self._cond.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; requests still running get `EngineDeadError`."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            self.engine.shutdown()  # distributed: stop the worker processes

    def _submit(self, cmd: _AddCommand | _CallCommand) -> None:
        with self._cond:
            if self._closed:  # the thread stopped after _check_alive: nobody would resolve the future
                raise EngineDeadError("the engine is shut down")
            self._commands.append(cmd)
            self._cond.notify()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine thread crashed: {self._dead!r}")
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            set_compute_threads(self.engine.config.num_threads)  # a per-thread setting: the builder's does not reach here
            while True:
                with self._cond:
                    while not self._commands and not self._stopping and not self.engine.has_unfinished_requests():
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                for cmd in commands:
                    self._apply(cmd)
                self._stats = self.engine.get_stats()
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:  # a bug outside step(): report it instead of hanging clients
            logger.exception("kvflow engine thread crashed")
            self._dead = exc
        finally:
            self._fail_all(EngineDeadError(f"the engine failed while the request was running: {self._dead}"
                                           if self._dead is not None else
                                           "the engine shut down while the request was running"))
            if self._dead is not None:
                self.engine.shutdown()  # distributed workers: stop the survivors

    def _apply(self, cmd: _AddCommand | _AbortCommand | _CallCommand) -> None:
        if isinstance(cmd, _CallCommand):
            try:
                result, error = cmd.fn(self.engine), None
            except Exception as exc:  # the caller's bug: its own future fails, the engine goes on
                result, error = None, exc
            _resolve(cmd.future, error, result)
            return
        if isinstance(cmd, _AbortCommand):
            if cmd.stream is not None and self._streams.get(cmd.request_id) is not cmd.stream:
                return  # the id now belongs to another request (or this one already finished)
            if cmd.sample is not None:
                self.engine.abort_sample(cmd.request_id, cmd.sample)
                if not self.engine.has_request(cmd.request_id) and cmd.stream is not None:
                    # That was its last sample running (the others ended since): the stream ends here.
                    del self._streams[cmd.request_id]
                    self._deliver({cmd.stream.loop: [(cmd.stream, None)]})
                return
            stream = self._streams.pop(cmd.request_id, None)
            try:
                if self.engine.abort_request(cmd.request_id) and stream is not None:
                    logger.debug("aborted request %s", cmd.request_id)
            except Exception:  # a bookkeeping bug must not take the engine thread (and every caller) down
                logger.exception("aborting request %s failed", cmd.request_id)
            return
        try:
            if self.max_waiting is not None:  # n samples are one request
                waiting = self.engine.num_waiting_for_a_slot()
                if waiting >= self.max_waiting:
                    raise EngineOverloadedError(waiting, self.max_waiting)
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time, cmd.priority,
                                    cmd.lora_request)
        except Exception as exc:  # ValueError (bad prompt), overload, anything: back to the caller
            _resolve(cmd.future, exc)
            return
        self._streams[cmd.request_id] = cmd.stream
        _resolve(cmd.future, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            if getattr(exc, "fatal", False):  # a distributed worker is gone: no later step can run
                raise
            self._fail_batch(exc)
            return
        # Refresh the snapshot before anyone hears of this step: a client that saw its request
        # finish must also see its blocks back in the pool.
        self._stats = self.engine.get_stats()
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | BaseException]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            deliveries.setdefault(stream.loop, []).append((stream, out))
        self._deliver(deliveries)
        for listener in self._step_listeners:
            try:
                listener(self.engine)
            except Exception:  # a listener's bug must not stop the engine
                logger.exception("a step listener failed")

    def _fail_batch(self, exc: Exception) -> None:
        """Fail the requests the failed step was running; the waiting ones keep their turn."""
        self.num_step_errors += 1
        logger.exception("kvflow engine step failed; failing the requests in the batch")
        running = self.engine.running_request_ids()  # a request with n > 1 runs as several sequences
        # Requests that finished earlier in the failed step are gone from the engine, but their
        # final output was lost with the exception: they must hear of the failure too.
        orphans = [rid for rid in self._streams if not self.engine.has_request(rid)]
        affected = list(dict.fromkeys(running + orphans)) or list(self._streams)  # unknown batch: fail everyone
        error = EngineStepError(f"the engine failed while running this request: {exc!r}")
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id in affected:
            self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                deliveries.setdefault(stream.loop, []).append((stream, error))
        self._stats = self.engine.get_stats()
        self._deliver(deliveries)

    def _fail_all(self, error: BaseException) -> None:
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine may be what broke; the clients still need an answer
                pass
            deliveries.setdefault(stream.loop, []).append((stream, error))
        self._streams.clear()
        with self._cond:
            self._closed = True
            pending, self._commands = self._commands, []
        for cmd in pending:
            if isinstance(cmd, (_AddCommand, _CallCommand)):
                _resolve(cmd.future, EngineDeadError("the engine is shut down"))
        self._deliver(deliveries)

    def _deliver(self, deliveries: dict[asyncio.AbstractEventLoop, list]) -> None:
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                for stream, _ in items:
                    if self.engine.abort_request(stream.request_id):
                        self._streams.pop(stream.request_id, None)
