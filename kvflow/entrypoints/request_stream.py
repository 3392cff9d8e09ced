"""A request's output stream and the engine errors it can raise, shared by both engines.

`AsyncEngine` (the engine thread in this process) and `EngineCoreClient` (the engine core in
another process, `core/client.py`) hand outputs to the same `RequestStream`s, from a thread that
is not the event loop's: `_put_all` and `_resolve` are how such a thread reaches a loop (one
`call_soon_threadsafe` per step and loop). The routes consume the stream alike in both modes.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from kvflow.outputs import RequestOutput


class _Owner(Protocol):
    def abort(self, request_id: str, stream: "RequestStream | None" = None) -> None: ...


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the client should retry after `retry_after` seconds."""

    def __init__(self, num_waiting: int, max_waiting: int, retry_after: int = 1) -> None:
        super().__init__(
            f"the server is overloaded: {num_waiting} requests are already waiting for a batch slot "
            f"(max_waiting={max_waiting}); "
            "retry later"
        )
        self.num_waiting, self.max_waiting, self.retry_after = num_waiting, max_waiting, retry_after


class EngineStepError(RuntimeError):
    """A step raised while this request was in the batch; the request was aborted."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or crashed outside a step)."""


class RequestStream:
    """The outputs of one request, as an async iterator of per-step `RequestOutput`s.

    Iteration ends after the output with `finished=True`. Leaving early (client gone) must
    call `abort()` so that the engine frees the request's blocks; it is idempotent and a
    no-op once the request finished.
    """

    def __init__(self, request_id: str, owner: _Owner, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the event loop thread (via call_soon_threadsafe) by the engine thread."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:  # abort() woke a waiting reader
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def next(self) -> RequestOutput | None:
        """The next output, or None after the last one (a plain coroutine, usable as a Task)."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            return None

    def abort(self) -> None:
        """Stop the request in the engine (freeing its blocks) unless it already finished."""
        if not self.finished:
            self.finished = True
            try:
                self._owner.abort(self.request_id, self)
            finally:  # a reader waiting on the queue must wake even if the owner's abort failed
                self._queue.put_nowait(None)


def _put_all(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put(item)


def _resolve(future: asyncio.Future, exc: BaseException | None, result: Any = None) -> None:
    """Complete a command's future from the engine thread."""

    def finish() -> None:
        if future.done():  # the caller was cancelled; its abort command cleans up
            return
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)

    try:
        future.get_loop().call_soon_threadsafe(finish)
    except RuntimeError:
        pass

