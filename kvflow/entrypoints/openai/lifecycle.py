"""Draining on SIGTERM: stop taking requests, let the ones in flight finish, then exit 0.

A deployment restarts a server by sending SIGTERM and, a grace period later, SIGKILL. Left to
itself uvicorn closes its listening socket at once (a load balancer still routing here sees
connection refused instead of an answer), waits without limit for open connections, and
then re-raises the signal, so the process dies "killed by SIGTERM" rather than exiting 0.
Here the first SIGTERM (or Ctrl-C) turns the server into *draining*:

- the socket stays open, and every new /v1 request is refused with 503 in OpenAI's error
  shape (`code: "draining"`, `Connection: close`), and /health answers 503 likewise, so
  health checks take the replica out of rotation;
- requests already in flight (a stream included) run to their end, for at most
  `shutdown_timeout` seconds; past that the engine is stopped, which ends each remaining
  request with an error event, so every client still gets a well-formed end;
- then uvicorn shuts down (no connection left to wait for) and `kvflow serve` exits 0.

A second SIGTERM or Ctrl-C while draining exits at once (status 1), cutting what is left.
`DrainMiddleware` counts the requests in flight and refuses new ones; `GracefulServer`
turns the signals into the steps above.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.openai.errors import error_response

logger = logging.getLogger("kvflow")

DRAIN_POLL_S = 0.05  # how often the drain checks whether the last request in flight has ended
ABORT_GRACE_S = 5.0  # after the timeout: time for aborted requests to write their error and close
FORCED_EXIT_STATUS = 1  # the second signal: requests were cut, so not a clean exit


@dataclass
class DrainState:
    """Whether the server is draining, and how many /v1 requests are being answered now.

    Touched only on the event loop (the middleware and the drain task), so no lock.
    """

    draining: bool = False
    in_flight: int = 0

    async def wait_idle(self, timeout: float) -> bool:
        """True once no /v1 request is in flight; False if `timeout` seconds passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight > 0:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True


DRAINING_MESSAGE = ("The server is shutting down (draining): it accepts no new requests and finishes the ones "
                    "in flight. Retry on another replica, or here once it has restarted.")


class DrainMiddleware:
    """Plain ASGI: counts /v1 requests until their response ends; refuses new ones while draining.

    A streaming response counts until its last byte is sent (the ASGI call returns only
    then), which is what "in flight" must mean for the drain to wait on it.
    """

    def __init__(self, app: Any, state: DrainState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.state.draining and (path == "/health" or path.startswith("/v1") or path == "/dashboard/events"):
            response = error_response(503, DRAINING_MESSAGE, "server_error", code="draining",
                                      headers={"Retry-After": "1", "Connection": "close"})
            await response(scope, receive, send)
            return
        if not path.startswith("/v1"):
            await self.app(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn's server with kvflow's signal handling: drain on the first signal, exit on the second."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, state: DrainState,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.state, self.shutdown_timeout = engine, state, shutdown_timeout
        self.num_signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    exit_status = 0

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        self._watch_task = asyncio.ensure_future(self._watch_engine())

    async def _watch_engine(self) -> None:
        """An engine that died on its own (a distributed worker failed) ends the server with
        status 1 instead of leaving a process that answers 503 forever; /health already says so."""
        while not self.should_exit:
            if not self.engine.is_running and not self.state.draining:
                logger.error("the engine stopped (%s); exiting with status 1", self.engine._dead or "shut down")
                self.exit_status = 1
                self.state.draining = True
                await self.state.wait_idle(ABORT_GRACE_S)  # the failed requests' error responses go out
                self.should_exit = True
                return
            await asyncio.sleep(0.25)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs as the signal handler, on the main thread; never re-raises the signal (exit 0)."""
        self.num_signals += 1
        name = signal.Signals(sig).name
        if self.num_signals > 1:
            logger.warning("second %s while draining: exiting now, cutting %d request(s) in flight",
                           name, self.state.in_flight)
            sys.stderr.flush()
            os._exit(FORCED_EXIT_STATUS)
        if self._loop is None or self._loop.is_closed():  # not serving yet: nothing to drain
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain, name)

    def _begin_drain(self, signal_name: str) -> None:
        self._drain_task = asyncio.ensure_future(self.drain(signal_name))

    async def drain(self, reason: str = "drain") -> None:
        """Refuse new requests, wait for those in flight (bounded), then let uvicorn shut down."""
        self.state.draining = True
        logger.info("%s: draining; %d request(s) in flight, waiting at most %g s for them (send it again to "
                    "exit now)", reason, self.state.in_flight, self.shutdown_timeout)
        if await self.state.wait_idle(self.shutdown_timeout):
            logger.info("drained: no request in flight; shutting down")
        else:
            logger.warning("shutdown timeout (%g s): aborting %d request(s) still in flight",
                           self.shutdown_timeout, self.state.in_flight)
            await asyncio.to_thread(self.engine.shutdown)  # their streams end with an error event
            if not await self.state.wait_idle(ABORT_GRACE_S):
                logger.warning("%d request(s) did not end after the abort; closing their connections",
                               self.state.in_flight)
        self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the weights load: a port in use fails at once, not after
    the model has loaded (uvicorn then listens on this socket). OSError naming the address.

    IPv6 only for a host written as one, as uvicorn binds: "localhost" is 127.0.0.1, where
    clients and `kvflow router --instance http://127.0.0.1:PORT` look, not ::1."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = None
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: no wait after a restart
        sock.bind(address)
    except OSError as exc:  # an unknown host, an address not here, a port in use
        if sock is not None:
            sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port} (--host, --port): {exc.strerror or exc}") from None
    return sock


def serve_until_drained(app: Any, engine: AsyncEngine, sock: socket.socket, log_level: str = "info",
                        shutdown_timeout: float = 30.0) -> int:
    """Serve `app` (from `build_app`) on `sock` (`bind_socket`) until a signal has drained it; the
    exit status (0, or 1 when the engine died on its own).

    uvicorn's own graceful-shutdown timeout only backs the drain up: by the time uvicorn
    shuts down, nothing should be in flight any more.
    """
    if shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=ABORT_GRACE_S)
    server = GracefulServer(config, engine, app.state.drain, shutdown_timeout)
    server.run(sockets=[sock])
    return server.exit_status
