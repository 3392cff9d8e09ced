"""Parallel sampling: `SamplingParams(n=k)` runs k samples of one request over one prompt's KV.

Each sample is a `Sequence` of its own (its own block table tail, detokenizer, stop checks,
seeded generator and preemption fate), keyed in the engine by an internal id derived from the
request's. What they share is the prompt, and it is computed once:

1. Sample 0 is queued alone. Samples 1..k-1 are *held* by the engine, outside the scheduler.
2. When sample 0's prompt is fully computed (its first token is out), the held samples are
   queued in the request's own place in line (its arrival index, not behind later arrivals).
3. At admission each takes the prompt's full blocks by reference: through the prefix cache
   when it is on, and in any case from a sibling's block table (`KVCacheManager.
   find_cached_prefix` looks at `Sequence.siblings`), so `enable_prefix_caching=False` shares
   too. Only the tokens after the last full prompt block are computed again (fewer than
   block_size, or one whole block when the prompt ends on a block boundary, because the last
   prompt token must be computed to have logits to sample from).
4. From there the samples diverge block by block: new tokens go into blocks of their own; the
   shared ones are full and never written again, so there is no copy-on-write to do.

The one case that recomputes the prompt: with the prefix cache off, if sample 0 finishes in the
very step that computed its prompt (max_tokens=1, or an immediate stop) before its siblings
are admitted, nobody holds the blocks any more. With the prefix cache on (the default) they
stay findable until evicted.

The engine answers one `RequestOutput` per request, its `outputs` the k `CompletionOutput`s in
index order, finished when every sample has finished, as vLLM does.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvflow.engine.sequence import Sequence
from kvflow.outputs import RequestOutput
from kvflow.sampling.params import SamplingParams

if TYPE_CHECKING:
    from kvflow.engine.scheduler import Scheduler, SchedulerOutput

_SEED_MASK = (1 << 63) - 1


def sample_request_id(request_id: str, index: int) -> str:
    """The engine-internal id of sample `index` (block tables, speculator state are keyed by it)."""
    return f"{request_id}:sample{index}"


def derive_seed(seed: int, index: int) -> int:
    """Sample `index`'s seed: sample 0 keeps the request's (so n=1 and sample 0 of n=k agree), the
    others draw independent streams from numpy's SeedSequence spawn keys, so that seed s's sample 1
    is not seed s+1's sample 0 as it would be with `seed + index`."""
    if index == 0:
        return seed
    state = np.random.SeedSequence(seed % (1 << 64), spawn_key=(index,)).generate_state(1, dtype=np.uint64)
    return int(state[0]) & _SEED_MASK


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s parameters: a derived seed; prompt logprobs are computed by sample 0 only."""
    if index == 0:
        return params
    out = copy.copy(params)
    if params.seed is not None:
        out.seed = derive_seed(params.seed, index)
    out.prompt_logprobs = None  # one scoring of the prompt serves the request; it also keeps the
    # sibling's admission free to take the shared prompt blocks (a scoring request may not)
    return out


def check_n(n: int, max_num_seqs: int) -> None:
    """Refuse an n whose samples could never all run at once (ValueError naming the field)."""
    if n > max_num_seqs:
        raise ValueError(f"n must be at most max_num_seqs ({max_num_seqs}): the samples of one request "
                         f"run side by side, got n={n}")


def prompt_tokens_computed(sched: "SchedulerOutput") -> int:
    """Prompt positions whose K/V this step computes (call before `update_after_step`).

    Prefix-cache hits and prompt blocks shared between samples are never scheduled, so they do not
    count; a prompt recomputed after a preemption does. This is the `prefill_tokens` counter.
    """
    total = 0
    for item in sched.scheduled:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens - len(item.spec_token_ids)
        total += max(0, min(end, seq.num_prompt_tokens) - start)
    return total


@dataclass(eq=False)
class SampleGroup:
    """The k samples of one request; `samples` are the engine's per-sample records, in index order."""

    request_id: str
    samples: list[Any]  # request_state.RequestState (each with .seq), index order
    held: list[Any] = field(default_factory=list)  # not queued yet: waiting for sample 0's prompt

    @property
    def finished(self) -> bool:
        return all(r.seq.is_finished for r in self.samples)

    def output(self, per_sample: list[RequestOutput]) -> RequestOutput:
        """One RequestOutput for the request from each sample's own (`per_sample`, index order)."""
        first = per_sample[0]
        finished = all(o.finished for o in per_sample)
        metrics = dataclasses.replace(
            first.metrics,
            last_token_time=max(o.metrics.last_token_time or 0.0 for o in per_sample) or None,
            finished_time=max(o.metrics.finished_time or 0.0 for o in per_sample) if finished else None,
            num_preemptions=sum(o.metrics.num_preemptions for o in per_sample),
        )
        completions = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(per_sample)]
        # new_token_ids/new_text are per-sample notions: a client reads each completion's progress.
        return dataclasses.replace(first, request_id=self.request_id, outputs=completions, finished=finished,
                                   metrics=metrics, new_token_ids=[], new_text="")


class SampleGroups:
    """The engine's requests with n > 1, by request id, and the samples they still hold back."""

    def __init__(self) -> None:
        self.groups: dict[str, SampleGroup] = {}
        self._pending: dict[str, SampleGroup] = {}  # groups with held samples

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def add_request(self, request_id: str, params: SamplingParams, make: Callable[[str, SamplingParams, int], Any],
                    records: dict[str, Any], scheduler: "Scheduler", max_num_seqs: int) -> SampleGroup:
        """Build the n samples with `make(sequence id, params, index)`, enter them in `records` (the
        engine's requests by sequence id) and queue sample 0; ValueError when n cannot be served."""
        check_n(params.n, max_num_seqs)
        samples = [make(sample_request_id(request_id, i), sample_params(params, i), i) for i in range(params.n)]
        if any(r.seq.request_id in records for r in samples):
            raise ValueError(f"request_id: {request_id!r} collides with a request already in use")
        records.update((r.seq.request_id, r) for r in samples)
        return self.add(request_id, samples, scheduler)

    def add(self, request_id: str, samples: list[Any], scheduler: "Scheduler") -> SampleGroup:
        """Register the samples (records with .seq and .group) and queue sample 0 alone."""
        group = SampleGroup(request_id, samples, held=samples[1:])
        seqs: list[Sequence] = [r.seq for r in samples]
        for r in samples:
            r.seq.siblings = seqs
            r.group = group
        self.groups[request_id] = group
        self._pending[request_id] = group
        scheduler.add(samples[0].seq)
        return group

    def release_ready(self, scheduler: "Scheduler") -> None:
        """Queue the held samples of every request whose sample 0 has computed its prompt."""
        for request_id, group in list(self._pending.items()):
            first = group.samples[0].seq
            if not (first.output_token_ids or first.is_finished):
                continue
            for r in group.held:
                scheduler.add(r.seq, arrival_index=first.arrival_index)
            group.held = []
            del self._pending[request_id]

    def outputs(self, advanced: list[Any], make_output: Callable[[Any], RequestOutput]) -> list[RequestOutput]:
        """One output per request that advanced this step; a request with n > 1 answers for all its samples."""
        outputs, seen = [], set()
        for req in advanced:
            if req.group is None:
                outputs.append(make_output(req))
            elif req.group.request_id not in seen:
                seen.add(req.group.request_id)
                outputs.append(req.group.output([make_output(r) for r in req.group.samples]))
        return outputs

    def abort_sample(self, request_id: str, index: int, abort_sequence: Callable[[str], bool]) -> bool:
        """Abort one sample (`abort_sequence(its sequence id)`) while its siblings go on; the request's
        outputs report it as aborted from here on. False if there was nothing to stop."""
        group = self.groups.get(request_id)
        if group is None or not 0 <= index < len(group.samples) or group.samples[index] in group.held:
            return False
        stopped = abort_sequence(group.samples[index].seq.request_id)
        if group.finished:  # the others had finished already: nothing of the request is left
            self.pop(request_id)
        return stopped

    @staticmethod
    def request_ids(seqs: list[Sequence], records: dict[str, Any]) -> list[str]:
        """The requests these sequences belong to, once each (a sample answers for its request)."""
        ids = []
        for seq in seqs:
            req = records.get(seq.request_id)
            ids.append(req.group.request_id if req is not None and req.group is not None else seq.request_id)
        return list(dict.fromkeys(ids))

    def pop(self, request_id: str) -> SampleGroup | None:
        self._pending.pop(request_id, None)
        return self.groups.pop(request_id, None)
