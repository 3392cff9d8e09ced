"""The "ray" backend: one Ray actor per rank, placed with a placement group.

`ray.init` joins the cluster named by RAY_ADDRESS (`ray start --head` on one machine, `ray start
--address=...` on the others) or, without it, starts a local one on demand. The actors are
created in a placement group of one CPU bundle per rank (PACK: as few nodes as fit), rank 0
picks the torch.distributed rendezvous port on its node, and every actor then joins the group
and builds its shard exactly as an `mp` worker does (`worker.build_stage`). Each step is one
`execute` call per actor with the same `StepMessage`; the output rank's return value is the
reply; a pipeline submits the next steps before it collects the first. A dead actor surfaces as Ray's actor error on its call and becomes `WorkerFailedError`;
a hang is bounded by the step timeout (KVFLOW_STEP_TIMEOUT).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time

from kvflow.distributed.executor import Executor, WorkerFailedError, free_port
from kvflow.distributed.messages import StepMessage, StepResult
from kvflow.distributed.worker import WorkerSpec

logger = logging.getLogger("kvflow")


class _RankActor:
    """The body of a Ray actor (wrapped with ray.remote at start-up, so importing this module
    never needs ray)."""

    def __init__(self, rank: int, spec: WorkerSpec) -> None:
        import torch

        self.rank, self.spec, self.runner = rank, spec, None
        torch.set_num_threads(max(1, spec.num_threads))

    def rendezvous(self) -> str:
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, init_method: str) -> dict:
        from kvflow.distributed.parallel_state import init_parallel_state
        from kvflow.distributed.worker import build_stage

        spec = dataclasses.replace(self.spec, init_method=init_method)
        state = init_parallel_state(self.rank, spec.parallel, init_method, timeout_s=spec.collective_timeout_s)
        self.runner = build_stage(spec, self.rank, state)
        return {"pid": os.getpid(), "rank": self.rank, "fused_stack": self.runner.fused is not None,
                "all_reduce": state.all_reduce_method}

    def execute(self, msg: StepMessage) -> StepResult | None:
        return self.runner.execute(msg)


def _connect(world_size: int):
    try:
        import ray
    except ImportError as exc:
        raise ValueError("distributed_executor_backend='ray': the ray package is not installed; "
                         "pip install 'kvflow[ray]' (or use 'mp')") from exc
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        try:
            if address:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            else:  # a local cluster, started now, with a CPU per rank at least
                ray.init(num_cpus=max(world_size, os.cpu_count() or 1), include_dashboard=False,
                         log_to_driver=False)
        except (ConnectionError, RuntimeError) as exc:
            raise ValueError(f"distributed_executor_backend='ray': no Ray cluster answers at RAY_ADDRESS="
                             f"{address!r} ({exc})") from exc
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < world_size:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world_size} ranks, but the Ray cluster "
                         f"has {cpus:g} CPUs")
    return ray


class RayExecutor(Executor):
    def __init__(self, spec_for_rank, world_size: int, output_rank: int, start_timeout_s: float = 300.0,
                 step_timeout_s: float | None = None) -> None:
        ray = self._ray = _connect(world_size)
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_pg = remove_placement_group
        self.output_rank, self.failure = output_rank, None
        self._in_flight: collections.deque = collections.deque()  # each submitted step's refs, oldest first
        self.step_timeout_s = step_timeout_s if step_timeout_s is not None else float(
            os.environ.get("KVFLOW_STEP_TIMEOUT", "120"))
        self._pg = placement_group([{"CPU": 1}] * world_size, strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=start_timeout_s)
        except Exception as exc:
            self._remove_pg(self._pg)
            raise RuntimeError(f"the Ray placement group of {world_size} CPUs was not placed within "
                               f"{start_timeout_s:.0f} s: {exc}") from exc
        actor_cls = ray.remote(num_cpus=1)(_RankActor)
        spec: WorkerSpec = spec_for_rank("")
        self._actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self._pg, placement_group_bundle_index=rank)).remote(rank, spec)
            for rank in range(world_size)]
        try:
            init_method = ray.get(self._actors[0].rendezvous.remote(), timeout=start_timeout_s)
            self.worker_info = ray.get([a.start.remote(init_method) for a in self._actors], timeout=start_timeout_s)
        except Exception as exc:
            self._kill()
            raise RuntimeError(f"a Ray worker failed to start: {exc}") from exc

    @property
    def worker_pids(self) -> list[int]:
        return [info["pid"] for info in self.worker_info]

    def submit(self, msg: StepMessage) -> None:
        """One `execute` call per actor; an actor runs its calls in the order they were made, so
        steps submitted back to back queue up on each rank as they do on an `mp` worker's pipe."""
        if self.failure is not None:
            raise WorkerFailedError(f"the distributed executor is down: {self.failure}")
        msg_ref = self._ray.put(msg)  # stored once, read by every actor
        self._in_flight.append([a.execute.remote(msg_ref) for a in self._actors])

    def collect(self) -> StepResult:
        if self.failure is not None:
            raise WorkerFailedError(f"the distributed executor is down: {self.failure}")
        ray, refs = self._ray, self._in_flight[0]  # popped once answered: an interrupt leaves it first
        pending, deadline = list(refs), time.monotonic() + self.step_timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:  # RayActorError (the process died) or the rank's own exception
                    self._fail(f"Ray worker rank {refs.index(ref)} failed: {exc}")
            if pending and time.monotonic() > deadline:
                self._fail(f"the step took over {self.step_timeout_s:.0f} s (KVFLOW_STEP_TIMEOUT); a worker is stuck")
        result = ray.get(refs[self.output_rank])
        self._in_flight.popleft()
        return result

    def _fail(self, why: str) -> None:
        self.failure = why
        logger.error("kvflow: %s; stopping all workers", why)
        self._kill()
        raise WorkerFailedError(why)

    def _kill(self) -> None:
        for actor in self._actors:
            try:
                self._ray.kill(actor)
            except Exception:
                pass
        try:
            self._remove_pg(self._pg)
        except Exception:
            pass

    def shutdown(self) -> None:
        if self.failure is None:
            self.failure = "shut down"
            self._kill()
