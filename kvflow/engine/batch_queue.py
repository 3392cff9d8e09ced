"""Several batches in flight, for a pipeline of stages: the engine's step under P > 1.

With one batch at a time, a P-stage pipeline keeps one stage busy while the P - 1 others wait
for it (stage 2 idles while stage 1 computes the batch, and then the other way round). The
queue keeps up to `depth` = P batches submitted: while stage 2 finishes batch A, stage 1
already computes batch B. P is the number that keeps every stage busy; a deeper queue would
only lengthen each sequence's wait for its token (its next batch cannot be formed before it),
and a shallower one leaves stages idle.

A batch's sequences stay out of the next batches until its tokens are back: their next input
is the token this batch samples. So that the P batches are not one full batch and P - 1
empty ones, each batch takes at most ceil(unfinished sequences / P) sequences: in a steady
decode the running sequences split into P groups that take turns (vLLM gets the same effect
from P schedulers, its virtual engines, each owning its sequences; one scheduler with
the in-flight set excluded keeps preemption and admission global).

Exactness: the blocks a batch in flight writes stay allocated to its sequences (the scheduler
took them when it formed the batch); those sequences are never chosen for preemption; an
aborted one's blocks are freed at once and may go to a later batch, which every stage runs
after the aborted one's, so the stale writes land first and are overwritten; its reply is
dropped. Results are applied in the order the batches were formed, one per engine step.
The queue is the distributed engine's only (`LLMEngine` builds it for P > 1); the
one-process step does not go through it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvflow.engine.model_runner import StepOutput
from kvflow.engine.scheduler import Scheduler, SchedulerOutput
from kvflow.engine.sequence import Sequence


@dataclass
class InFlightBatch:
    sched: SchedulerOutput
    pending: Any  # the runner's handle for the reply (distributed.driver_runner.PendingStep)


class BatchQueue:
    def __init__(self, scheduler: Scheduler, runner, depth: int) -> None:
        """`runner` has `submit(SchedulerOutput) -> handle` and `collect(handle) -> StepOutput`
        (the `DriverRunner`), answering in submission order."""
        if depth < 1:
            raise ValueError(f"batch queue depth: {depth} must be at least 1")
        self.scheduler, self.runner, self.depth = scheduler, runner, depth
        self._batches: deque[InFlightBatch] = deque()
        self._in_flight: set[Sequence] = set()
        self.peak_in_flight = 0  # the most batches submitted at once (tests assert the overlap)
        self.num_batches = 0

    @property
    def num_in_flight(self) -> int:
        return len(self._batches)

    @property
    def busy(self) -> bool:
        return bool(self._batches)

    def in_flight_sequences(self) -> list[Sequence]:
        """The sequences of the batches submitted and not yet applied, oldest batch first."""
        return [item.seq for batch in self._batches for item in batch.sched.scheduled]

    def fill(self) -> None:
        """Form and submit batches until `depth` are in flight or nothing is left to schedule."""
        while len(self._batches) < self.depth:
            s = self.scheduler
            cap = max(1, math.ceil((len(s.running) + len(s.waiting)) / self.depth))
            sched = s.schedule(self._in_flight, cap)
            if sched.is_empty:
                break
            self._batches.append(InFlightBatch(sched, self.runner.submit(sched)))
            self._in_flight.update(item.seq for item in sched.scheduled)
            self.num_batches += 1
            self.peak_in_flight = max(self.peak_in_flight, len(self._batches))

    def pop(self) -> tuple[SchedulerOutput, StepOutput] | None:
        """Wait for the oldest batch; it and its tokens, less the sequences finished (aborted)
        while it was in flight. None when nothing is in flight."""
        if not self._batches:
            return None
        batch = self._batches[0]
        result = self.runner.collect(batch.pending)  # an interrupt here leaves the batch first in line
        self._batches.popleft()
        self._in_flight.difference_update(item.seq for item in batch.sched.scheduled)
        live = [item for item in batch.sched.scheduled if not item.seq.status.is_finished]
        if len(live) < len(batch.sched.scheduled):
            result = StepOutput([r for r in result.sampled if not r.seq.status.is_finished], result.prompt_logprobs,
                                [p for p in result.pooled if not p.seq.status.is_finished])
            batch.sched = SchedulerOutput(live, batch.sched.preempted)
        return batch.sched, result
