"""Which sequences run this step, and how many tokens each.

There are no prefill or decode phases, only a token budget per step
(`max_num_batched_tokens`). Running sequences are served first: decodes (one token each),
then unfinished prefills, whose remaining prompt is cut to what the budget has left
(chunked prefill). Then waiting requests are admitted, in priority/arrival order, while
`max_num_seqs`, the budget and free KV blocks allow (keeping one free block per running
sequence as headroom, so an admission does not force a preemption on the next decode); each
starts after the longest prefix the cache already holds. A LoRA request whose adapter would
make more than `max_loras` distinct adapters run at once waits, and the requests behind it
may pass. When a running sequence needs a block and none is free, the
lowest-priority running sequence (latest arrival under FCFS) is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later. Under pipeline
parallelism several batches are in flight at once (engine/batch_queue.py): the sequences of
those are skipped, and never chosen as victims, until their tokens are back.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    import torch


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Free blocks kept per running sequence when admitting a new one: without this headroom an
    # admission can fill the pool, and the next decode step preempts (thrashing near a full cache).
    admission_headroom_blocks: int = 1
    # Distinct LoRA adapters among the running sequences (vLLM's max_loras); None: no adapters served.
    max_loras: int | None = None


@dataclass
class ScheduledSequence:
    seq: Sequence
    # Tokens [seq.num_computed_tokens, + num_new_tokens) are computed this step: the
    # sequence's own, then its draft tokens (speculative decoding), which come last.
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: "torch.Tensor | None" = None  # [len(spec_token_ids), V], from a draft model

    @property
    def is_sampled(self) -> bool:
        """A chunk that reaches the end of the sequence yields a token; partial chunks do not."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens + len(self.spec_token_ids)

    @property
    def needs_logits(self) -> bool:
        """Its last row (and drafts) go through the LM head: a sampled chunk, unless the sequence is
        an embedding request, whose completed prompt goes to the pooler instead."""
        return self.is_sampled and self.seq.pooling is None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.left_waiting = False  # the last schedule() could not admit every waiting sequence
        self.running: list[Sequence] = []  # sorted by (priority, arrival)
        self.num_preemptions = 0
        self._arrivals = 0

    # ---- requests in and out ---------------------------------------------------------
    def add(self, seq: Sequence, arrival_index: int | None = None) -> None:
        """Queue a sequence; `arrival_index` keeps an earlier place in line (a parallel sample
        released after its request's prompt was computed is served in its request's turn)."""
        if arrival_index is None:
            arrival_index, self._arrivals = self._arrivals, self._arrivals + 1
        seq.arrival_index = arrival_index
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire a sequence and return its blocks to the pool at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = status
        seq.finished_time = time.time()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step --------------------------------------------------------------------
    def schedule(self, in_flight: set[Sequence] | None = None, max_seqs: int | None = None) -> SchedulerOutput:
        """The next batch. A pipeline (engine/batch_queue.py) passes the sequences of the batches
        still in flight, which are neither scheduled (their next token is not known yet) nor
        preempted (their blocks are being written), and a cap on this batch's sequences."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: dict[str, ScheduledSequence] = {}
        cap = max_seqs if max_seqs is not None else self.config.max_num_seqs

        for seq in sorted(self.running, key=lambda s: (s.is_prefill, s.sort_key())):
            if budget == 0 or len(out.scheduled) >= cap:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if in_flight and seq in in_flight:
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = max(self.running if not in_flight else [s for s in self.running if s not in in_flight],
                             key=Sequence.sort_key)
                undone = scheduled_ids.pop(victim.request_id, None)
                if undone is not None:
                    out.scheduled.remove(undone)
                    budget += undone.num_new_tokens
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            item = ScheduledSequence(seq, num_new)
            out.scheduled.append(item)
            scheduled_ids[seq.request_id] = item
            budget -= num_new

        loras = {s.lora_int_id for s in self.running} - {0}
        index = 0  # waiting[:index] are LoRA requests passed over: their adapter would exceed max_loras
        while (index < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(out.scheduled) < cap):
            seq = self.waiting[index]
            if seq in out.preempted:
                break  # do not bounce a sequence straight back in the step that evicted it
            if seq.lora_int_id and seq.lora_int_id not in loras and len(loras) >= (self.config.max_loras or 0):
                index += 1  # its turn comes when a running adapter's last sequence leaves
                continue
            cached = self.kv.find_cached_prefix(seq)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            seq.num_computed_tokens = num_cached
            # Headroom: leave one free block per running sequence for its next decode, so that
            # admitting a request does not immediately force a preemption (thrashing).
            headroom = self.config.admission_headroom_blocks * len(self.running)
            if self.kv.num_blocks_to_take(seq, num_new, cached) + headroom > self.kv.num_free_blocks:
                seq.num_computed_tokens = 0
                break
            self.kv.allocate_slots(seq, num_new, cached)
            if seq.num_cached_tokens < 0:  # first admission: this is what the prefix cache saved
                seq.num_cached_tokens = num_cached
                self.kv.record_prefix_lookup(seq.num_prompt_tokens, num_cached)
                seq.first_scheduled_time = time.time()
            self.waiting.pop(index)
            if seq.lora_int_id:
                loras.add(seq.lora_int_id)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=Sequence.sort_key)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

        self.left_waiting = bool(self.waiting)
        self._add_drafts(out, budget)
        out.scheduled.sort(key=lambda s: s.num_new_tokens > 1)  # single-token rows first (batched decode)
        return out

    def free_slots(self) -> int:
        """Batch slots the next step can surely fill from the waiting queue: none when the last
        step already left sequences waiting (for slots, KV blocks or budget: a full pool must not
        read as free slots while preempted sequences queue), else max_num_seqs less the running."""
        return 0 if self.left_waiting else max(0, self.config.max_num_seqs - len(self.running))

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Draft tokens (speculative decoding) ride along with decodes, last: only from the budget and
        free blocks that every sequence's own tokens and admissions left, and never preempting anyone."""
        for item in out.scheduled:
            seq = item.seq
            drafts, seq.spec_token_ids = seq.spec_token_ids, []
            draft_probs, seq.spec_draft_probs = seq.spec_draft_probs, None
            drafts = drafts[: max(0, budget)]
            if not drafts or not item.num_new_tokens == 1 == seq.num_tokens - seq.num_computed_tokens:
                continue  # drafts only follow a decode
            if not self.kv.allocate_slots(seq, 1 + len(drafts)):
                continue
            item.num_new_tokens += len(drafts)
            item.spec_token_ids = drafts
            item.spec_draft_probs = draft_probs[: len(drafts)] if draft_probs is not None else None
            budget -= len(drafts)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def update_after_step(self, out: SchedulerOutput, num_rejected: dict[str, int] | None = None) -> None:
        """Advance each scheduled sequence past the tokens whose K/V this step wrote and kept.

        `num_rejected[request_id]` counts draft tokens the verification threw away: their K/V
        is stale, so `num_computed_tokens` stops before them and blocks holding nothing
        else go back to the pool. Call this after the step's tokens are appended, so that
        the prefix cache hashes the accepted tokens.
        """
        num_rejected = num_rejected or {}
        for item in out.scheduled:
            seq = item.seq
            rejected = num_rejected.get(seq.request_id, 0)
            seq.num_computed_tokens += item.num_new_tokens - rejected
            if rejected:
                self.kv.trim(seq)
            self.kv.cache_full_blocks(seq)
