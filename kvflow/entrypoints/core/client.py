"""The API server's handle on the engine core process, shaped like `AsyncEngine`.

`EngineCoreClient` starts `process.run_engine_core` in a spawned child and offers what the
server, the dashboard and the drain logic use of an `AsyncEngine`: `add_request` (returning the
same `RequestStream`), `abort`, `call`, `get_stats`, `is_running`, `shutdown`, the tokenizer and
the model's limits. Tokenization, detokenization and stop strings happen here, in the API server
process (the client loads the same tokenizer): the core sends token ids, and a request that a
stop string ends is aborted in the core at once, so its blocks go back to the pool
(`assembler.py`).

One receiver thread reads the core's PUSH socket and hands each step's outputs to the streams'
event loops with one `call_soon_threadsafe` per step and loop, as the in-process engine thread
does. It also watches the child: if the core process dies, every request in flight fails with
`EngineDeadError` (an OpenAI-shaped 500, or an error event in a stream), pending adds and calls
fail too, `is_running` turns false (so /health answers 503), and nothing waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import zmq

from kvflow.config import EngineConfig
from kvflow.engine.inputs import (PromptInput, cache_salt_of, check_prompt_token_ids, load_tokenizer_or_none,
                                  tokenize_prompt, truncate_prompt)
from kvflow.engine.request_state import EngineStats
from kvflow.entrypoints.request_stream import EngineDeadError, RequestStream, _put_all, _resolve
from kvflow.entrypoints.core import wire
from kvflow.entrypoints.core.assembler import OutputAssembler
from kvflow.loader.generation_config import SamplingDefaults
from kvflow.lora.request import LoRARequest
from kvflow.pooling.params import PoolingParams
from kvflow.sampling.params import SamplingParams

logger = logging.getLogger("kvflow")
POLL_MS = 100  # how often the receiver thread looks at the child when no message comes
STARTUP_TIMEOUT_S = 900.0


class EngineCoreClient:
    """An `AsyncEngine` look-alike whose engine runs in a child process (see module docstring)."""

    def __init__(self, config: EngineConfig, max_waiting: int | None = None,
                 startup_timeout: float = STARTUP_TIMEOUT_S, kv_transfer_config: Any = None) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        self.max_waiting = max_waiting
        self.num_step_errors = 0
        self._dir = tempfile.mkdtemp(prefix="kvflow-core-")  # mode 0700: only this user reaches the sockets
        self._ctx = zmq.Context()
        self._cmd = self._ctx.socket(zmq.PUSH)
        self._cmd.setsockopt(zmq.LINGER, 0)
        self._cmd.bind(f"ipc://{self._dir}/commands")
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(f"ipc://{self._dir}/outputs")
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the tables below (event loops and the receiver thread)
        self._streams: dict[str, RequestStream] = {}
        self._adds: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._dead: str | None = None
        self._stopping = False
        # A fresh interpreter (`python -m ...process`), not multiprocessing: spawn would re-import the
        # caller's __main__, which a script without a main guard cannot survive.
        with open(os.path.join(self._dir, "start.pkl"), "wb") as f:
            pickle.dump({"config": config, "max_waiting": max_waiting, "commands_addr": f"ipc://{self._dir}/commands",
                         "outputs_addr": f"ipc://{self._dir}/outputs", "parent_pid": os.getpid(),
                         "log_level": logging.getLogger("kvflow").getEffectiveLevel(),
                         "kv_transfer_config": kv_transfer_config}, f)
        self._proc = subprocess.Popen([sys.executable, "-m", "kvflow.entrypoints.core.process",
                                       os.path.join(self._dir, "start.pkl")])
        try:
            info = self._wait_ready(startup_timeout)
        except BaseException:
            self._kill()
            raise
        # Both ends are connected now, and connected ipc sockets outlive their paths: remove the
        # directory at once, so that no exit (a kill, the second SIGTERM's os._exit) leaves it behind.
        shutil.rmtree(self._dir, ignore_errors=True)
        self.model_path: str = info["model_path"]
        self.dtype_name: str = info["dtype"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.eos_token_ids: list[int] = info["eos_token_ids"]
        values, source = info["sampling_defaults"]
        self.sampling_defaults = SamplingDefaults(values, source)
        self.core_pid: int = info["pid"]
        self._stats: EngineStats = wire.decode_stats(info["stats"])
        self._kv_info: dict | None = info["kv_transfer"]
        self.tokenizer = load_tokenizer_or_none(info["tokenizer"] or self.model_path)
        self._assembler = OutputAssembler(self.tokenizer)
        self._thread = threading.Thread(target=self._receive, name="kvflow-core-client", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, max_waiting: int | None = None,
                    kv_transfer_config: Any = None) -> "EngineCoreClient":
        return cls(config, max_waiting=max_waiting, kv_transfer_config=kv_transfer_config)

    def _wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._out.poll(POLL_MS):
                msg = wire.unpack(self._out.recv())
                if msg[0] == wire.READY:
                    return msg[1]
                if msg[0] == wire.FAILED:
                    raise wire.decode_error(*msg[1:])  # e.g. the ValueError of a bad setting, as in-process
            elif self._proc.poll() is not None:
                raise RuntimeError(f"the engine core process exited during start-up (exit code {self._proc.returncode})")
        raise TimeoutError(f"the engine core did not start within {timeout:g} s")

    # ---- AsyncEngine's read side -----------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping and self._proc.poll() is None

    def get_stats(self) -> EngineStats:
        """The stats the core sent with its last step (or idle refresh)."""
        return self._stats

    def kv_transfer_info(self) -> dict | None:
        """The core's KV connector: role, address, counters (as of its last stats message)."""
        return self._kv_info

    # ---- the asyncio side ------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptInput,
                          params: SamplingParams | PoolingParams | None = None,
                          arrival_time: float | None = None, priority: int = 0,
                          kv_transfer_params: dict | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """As `AsyncEngine.add_request`; the prompt is tokenized here, then sent to the core."""
        self._check_alive()
        text, ids = tokenize_prompt(self.tokenizer, prompt)
        if params is not None:  # cut here too: the outputs assembled on this side carry the prompt's ids
            text, ids = truncate_prompt(text, ids, params.truncate_prompt_tokens, self.max_model_len)
        salt = cache_salt_of(prompt)
        # Token ids are checked here as the core would, before this side's detokenizer reads them.
        check_prompt_token_ids(ids, self.vocab_size)
        if isinstance(params, SamplingParams):
            params.check_token_ids(self.vocab_size)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop)
        future: asyncio.Future = loop.create_future()
        params = params or SamplingParams()
        with self._lock:
            if request_id in self._streams or request_id in self._adds:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            self._adds[request_id] = future
            self._streams[request_id] = stream
            self._assembler.start(request_id, text, ids, params, lora_request)
        try:
            # The core makes token ids only; the text and its stop strings are the assembler's.
            core_params = wire.encode_params(params)
            if isinstance(params, SamplingParams):
                core_params.update(stop=[], detokenize=False)
            try:
                self._send((wire.ADD, request_id, text, ids, core_params, arrival_time or time.time(),
                            priority, kv_transfer_params, wire.encode_lora(lora_request), salt))
            except OverflowError:  # msgpack packs integers of 64 bits at most
                raise ValueError("prompt: a number in the request (a token id, the priority) does not fit in "
                                 "64 bits") from None
            await future
        except BaseException:
            self.abort(request_id, stream)  # cancelled, refused or dead: the tables forget it
            raise
        return stream

    async def call(self, fn: Any) -> Any:
        """`fn(engine)` in the core between two steps; `fn` must be a module-level function (pickled)."""
        self._check_alive()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = future
        try:
            self._send((wire.CALL, call_id, pickle.dumps(fn)))
            return await future
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    def abort(self, request_id: str, stream: RequestStream | None = None) -> None:
        """Thread-safe; applies only while `request_id` still belongs to `stream` (when given)."""
        with self._lock:
            if stream is not None and self._streams.get(request_id) is not stream:
                return
            if self._streams.pop(request_id, None) is None:
                return
            self._adds.pop(request_id, None)
            self._assembler.forget(request_id)
        if self._dead is None and not self._stopping:
            self._send((wire.ABORT, request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core (requests still running end with `EngineDeadError`) and wait for it."""
        if self._stopping:
            return
        self._stopping = True
        if self._proc.poll() is None:
            try:
                self._send((wire.SHUTDOWN,))
            except zmq.ZMQError:
                pass
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core did not stop within %g s; killing it", timeout)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5.0)  # it drains what the core sent last, then fails what is left
        self._kill()

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5.0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _send(self, msg: tuple) -> None:
        data = wire.pack(msg)
        with self._send_lock:
            self._cmd.send(data)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._stopping or self._proc.poll() is not None:
            raise EngineDeadError("the engine is shut down")

    # ---- the receiver thread ---------------------------------------------------------------
    def _receive(self) -> None:
        try:
            while True:
                if self._out.poll(POLL_MS):
                    self._handle(wire.unpack(self._out.recv()))
                    continue
                code = self._proc.poll()
                if code is not None:
                    if not self._stopping:
                        self._dead = f"the engine core process died (exit code {code}) while the request was running"
                        logger.error("the engine core process died (exit code %s)", code)
                    break
        except Exception as exc:  # a bug here must not leave clients waiting
            logger.exception("the engine core client's receiver failed")
            self._dead = f"the engine core connection failed: {exc!r}"
        finally:
            self._fail_all(EngineDeadError(self._dead or "the engine shut down while the request was running"))

    def _handle(self, msg: list) -> None:
        kind = msg[0]
        if kind == wire.OUTPUTS:
            _, stats, num_errors, batch = msg
            self._stats, self.num_step_errors = wire.decode_stats(stats), num_errors  # before anyone hears of the step
            deliveries: dict[asyncio.AbstractEventLoop, list] = {}
            aborts: list[tuple] = []  # what a stop string ended here while the core still runs it
            with self._lock:
                for entry in batch:
                    stream = self._streams.get(entry[0])
                    if stream is None:
                        continue
                    if len(entry) == 4:  # [rid, kind, message, extra]: the request failed
                        item: Any = wire.decode_error(*entry[1:])
                        done = True
                    elif wire.is_pooled(entry):  # an embedding's vector
                        item, done = self._assembler.decode_pooled(entry), True
                        if item is None:
                            continue
                    else:
                        assembled = self._assembler.decode(entry)
                        if assembled is None:
                            continue
                        item, done = assembled.output, assembled.output.finished
                        if assembled.abort_request:
                            aborts.append((wire.ABORT, entry[0]))
                        aborts += [(wire.ABORT_SAMPLE, entry[0], i) for i in assembled.abort_samples]
                    if done:
                        del self._streams[entry[0]]
                        self._assembler.forget(entry[0])
                    deliveries.setdefault(stream.loop, []).append((stream, item))
            for abort in aborts if not self._stopping else ():  # sent before the streams hear of it
                self._send(abort)
            self._deliver(deliveries)
        elif kind == wire.STATS:
            self._stats, self.num_step_errors, self._kv_info = wire.decode_stats(msg[1]), msg[2], msg[3]
        elif kind == wire.ADDED:
            with self._lock:
                future = self._adds.pop(msg[1], None)
            if future is not None:
                _resolve(future, None)
        elif kind == wire.ADD_ERROR:
            _, rid, err_kind, message, extra = msg
            with self._lock:
                future = self._adds.pop(rid, None)
                self._streams.pop(rid, None)
                self._assembler.forget(rid)
            if future is not None:
                _resolve(future, wire.decode_error(err_kind, message, extra))
        elif kind == wire.CALL_RESULT:
            _, call_id, ok, payload = msg
            with self._lock:
                future = self._calls.pop(call_id, None)
            if future is not None:
                _resolve(future, None, pickle.loads(payload)) if ok else _resolve(future, wire.decode_error(*payload))
        elif kind == wire.DEAD:
            self._dead = msg[1]
        else:
            logger.error("engine core client: unknown message %r", kind)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            futures = list(self._adds.values()) + list(self._calls.values())
            self._adds, self._calls = {}, {}
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for stream in streams:
            deliveries.setdefault(stream.loop, []).append((stream, error))
        self._deliver(deliveries)
        for future in futures:
            _resolve(future, EngineDeadError(str(error)))

    @staticmethod
    def _deliver(deliveries: dict[asyncio.AbstractEventLoop, list]) -> None:
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody listens any more
                pass
