"""Executors: how the driver starts its workers, feeds them a step and hears back.

One interface (`Executor`), one implementation per backend:
  - "uni": no executor at all. One rank runs in the engine's own process through the plain
    `ModelRunner`, exactly as before this package existed (same speed, fused C++ stack).
  - "mp": `MPExecutor`, one spawned process per rank on this machine, torch.distributed
    between them (gloo on the CPU), one pipe each to the driver.
Failure handling is the executor's: a worker that exits (its process sentinel fires), stops
stamping its heartbeat for `heartbeat_timeout_s`, reports an error, or leaves a step
unanswered past `step_timeout_s` makes the step raise `WorkerFailedError`; the executor then
kills every worker and refuses further steps, and the engine fails the requests in flight.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
from abc import ABC, abstractmethod
from multiprocessing.connection import wait

from kvflow.distributed.messages import StepMessage, StepResult
from kvflow.distributed.worker import WorkerSpec, worker_main

logger = logging.getLogger("kvflow")


class WorkerFailedError(RuntimeError):
    """A worker died, hung or failed: the distributed engine cannot continue."""

    fatal = True  # the async engine stops (every request fails, /health turns 503) instead of going on


class Executor(ABC):
    """Steps go out with `submit` and their results come back, in the same order, with
    `collect`: a pipeline keeps several steps submitted before it collects the first (one per
    stage, engine/batch_queue.py); everything else calls `execute`, one step at a time."""

    @abstractmethod
    def submit(self, msg: StepMessage) -> None:
        """Send one step to every rank without waiting for it."""

    @abstractmethod
    def collect(self) -> StepResult:
        """The output rank's result of the oldest submitted step not yet collected."""

    def execute(self, msg: StepMessage) -> StepResult:
        """Run one step on every rank; the output rank's result."""
        self.submit(msg)
        return self.collect()

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""

    @property
    @abstractmethod
    def worker_pids(self) -> list[int]:
        ...

    # Per rank, what it said when ready: {"pid", "rank", "fused_stack", "all_reduce"} (whether its layers run
    # as one C++ call); filled at start-up.
    worker_info: list[dict]


def worker_start_method() -> str:
    """"spawn" (the default: a fresh interpreter per rank, safe whatever threads the driver
    runs) or "fork" (KVFLOW_WORKER_MULTIPROC_METHOD=fork, vLLM's variable's twin: no second
    import of torch, so a rank starts in a fraction of a second instead of seconds; only safe
    when the driver has run no OpenMP parallel region and holds no locks in other threads)."""
    method = os.environ.get("KVFLOW_WORKER_MULTIPROC_METHOD", "spawn")
    if method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"KVFLOW_WORKER_MULTIPROC_METHOD: {method!r} is not spawn, fork or forkserver")
    return method


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MPExecutor(Executor):
    """One spawned process per rank on this node."""

    def __init__(self, spec_for_rank, world_size: int, output_rank: int, start_timeout_s: float = 300.0,
                 step_timeout_s: float | None = None, heartbeat_timeout_s: float = 5.0) -> None:
        """`spec_for_rank(init_method) -> WorkerSpec`: the same spec for every rank, given the rendezvous address."""
        ctx = mp.get_context(worker_start_method())
        self.output_rank = output_rank
        self.step_timeout_s = step_timeout_s if step_timeout_s is not None else float(
            os.environ.get("KVFLOW_STEP_TIMEOUT", "120"))
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.failure: str | None = None
        self._in_flight = 0  # steps submitted and not yet collected
        self._outbox: queue.Queue = queue.Queue()  # steps for the sender thread (pipelined submits only)
        self._sender: threading.Thread | None = None
        self._sends_lock, self._sends_pending, self._send_error = threading.Lock(), 0, None
        spec: WorkerSpec = spec_for_rank(f"tcp://127.0.0.1:{free_port()}")
        self._conns, self._procs, self._clocks = [], [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            clock = ctx.Value("d", time.monotonic(), lock=False)
            proc = ctx.Process(target=worker_main, args=(rank, spec, child, clock), daemon=True,
                               name=f"kvflow-worker-{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
            self._clocks.append(clock)
        self._wait_ready(start_timeout_s)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _wait_ready(self, timeout_s: float) -> None:
        self.worker_info = [{} for _ in self._procs]
        pending = set(range(len(self._procs)))
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"workers {sorted(pending)} did not start within {timeout_s:.0f} s")
            ready = wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                         timeout=min(left, 1.0))
            for rank in list(pending):
                if self._conns[rank] in ready:
                    try:
                        kind, payload = self._conns[rank].recv()
                    except EOFError:
                        kind, payload = "error", "its pipe closed"
                    if kind == "error":
                        self._fail(f"worker rank {rank} failed to start: {payload}", start=True)
                    self.worker_info[rank] = payload
                    pending.discard(rank)
                elif self._procs[rank].sentinel in ready:
                    self._procs[rank].join(1)
                    self._fail(f"worker rank {rank} exited with code {self._procs[rank].exitcode} while starting "
                               "(workers are spawned: a script that builds an engine needs an "
                               "`if __name__ == '__main__':` guard)", start=True)

    def submit(self, msg: StepMessage) -> None:
        if self.failure is not None:
            raise WorkerFailedError(f"the distributed executor is down: {self.failure}")
        self._check_sender()
        if self._in_flight == 0 and self._sends_pending == 0:
            self._send_all(msg)  # nothing can be replying: send here (the one-step-at-a-time path)
        else:
            # A rank busy with an earlier step reads its pipe only when done, and a big step
            # blocks the write till then; meanwhile the output rank may block writing its
            # earlier reply (logits) to us. Sending from a thread keeps this thread reading.
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_loop, daemon=True, name="kvflow-step-sender")
                self._sender.start()
            with self._sends_lock:
                self._sends_pending += 1
            self._outbox.put(msg)
        self._in_flight += 1

    def _send_all(self, msg: StepMessage) -> None:
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(("step", msg))
            except (BrokenPipeError, OSError) as exc:
                self._fail(f"worker rank {rank} (pid {self._procs[rank].pid}) is gone: {exc!r}")

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send(("step", msg))
                except (BrokenPipeError, OSError) as exc:
                    self._send_error = f"worker rank {rank} (pid {self._procs[rank].pid}) is gone: {exc!r}"
                    return
            with self._sends_lock:
                self._sends_pending -= 1

    def _blame_the_dead(self) -> None:
        """If a rank has exited, fail naming it: it is the cause, not the ranks whose gloo calls it broke.
        A killed process's sockets close before it can be reaped, so give it half a second to show."""
        wait([p.sentinel for p in self._procs], timeout=0.5)
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                proc.join(1)
                self._fail(f"worker rank {rank} (pid {proc.pid}) died (exit code {proc.exitcode})")

    def _check_sender(self) -> None:
        if self._send_error is not None and self.failure is None:
            self._fail(self._send_error)

    def collect(self) -> StepResult:
        if self.failure is not None:
            raise WorkerFailedError(f"the distributed executor is down: {self.failure}")
        if self._in_flight == 0:
            raise RuntimeError("collect() without a submitted step")
        deadline = time.monotonic() + self.step_timeout_s
        out = self._conns[self.output_rank]
        watched = self._conns + [p.sentinel for p in self._procs]
        while True:
            ready = wait(watched, timeout=0.5)
            for rank, conn in enumerate(self._conns):
                if conn in ready:
                    try:
                        kind, payload = conn.recv()
                    except (EOFError, OSError):  # the process is gone (or going): say how it ended
                        self._procs[rank].join(1)
                        self._fail(f"worker rank {rank} (pid {self._procs[rank].pid}) died "
                                   f"(exit code {self._procs[rank].exitcode})")
                    if kind == "error":
                        self._blame_the_dead()  # a peer's death makes the survivors' collectives fail
                        self._fail(f"worker rank {rank} (pid {self._procs[rank].pid}) failed: {payload}")
                    if rank == self.output_rank:
                        self._in_flight -= 1  # only now: an interrupted wait leaves the reply to the next collect
                        return payload
            for rank, proc in enumerate(self._procs):
                if proc.sentinel in ready and not out.poll():
                    proc.join(1)
                    self._fail(f"worker rank {rank} (pid {proc.pid}) died (exit code {proc.exitcode})")
            now = time.monotonic()
            for rank, clock in enumerate(self._clocks):
                if now - clock.value > self.heartbeat_timeout_s:
                    self._fail(f"worker rank {rank} (pid {self._procs[rank].pid}) stopped answering "
                               f"(no heartbeat for {now - clock.value:.1f} s)")
            self._check_sender()
            if now > deadline:
                self._fail(f"the step took over {self.step_timeout_s:.0f} s (KVFLOW_STEP_TIMEOUT); "
                           "a worker is stuck")

    def _fail(self, why: str, start: bool = False) -> None:
        self.failure = why
        logger.error("kvflow: %s; stopping all workers", why)
        self._kill()
        if start:
            raise RuntimeError(why)
        raise WorkerFailedError(why)

    def _kill(self) -> None:
        self._outbox.put(None)  # the sender thread, if any, stops (or fails on a closed pipe)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()

    def shutdown(self) -> None:
        if self.failure is not None or not self._procs:
            return
        self.failure = "shut down"
        if self._sender is not None:  # let it finish its sends first: two writers would interleave on a pipe
            self._outbox.put(None)
            self._sender.join(5)
        for conn in self._conns:
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
