"""One request's state as the engine sees it.

The key quantity is `num_computed_tokens`: how many of the sequence's tokens (prompt, then
generated) already have K/V in the cache. The scheduler advances it by whatever chunk it
schedules; a sequence whose computed count reaches its length gets a token sampled.
A preempted sequence drops back to zero (or to its cached prefix) and recomputes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED)


@dataclass(eq=False)  # identity, not field-by-field: sequences are looked up in queues
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0  # lower is served first; ties broken by arrival order
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # when the step that gave its latest token ended
    first_scheduled_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    arrival_index: int = 0  # set by the scheduler: FCFS order among equal priorities
    # Draft tokens proposed for the next step (speculative decoding); not part of the output
    # until verified. The scheduler takes them (maybe fewer) and leaves this empty.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: torch.Tensor | None = None  # [k, V] the proposer's distributions; None: one-hot
    # SamplingParams.prompt_logprobs: entry i scores prompt token i under the model's
    # distribution at position i - 1 (entry 0 is None), with the token's rank there. Filled
    # chunk by chunk as the prompt is computed, each entry exactly once.
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    # Parallel sampling (SamplingParams.n > 1): every sample of the request, this one included, in
    # index order (one list shared by the samples). Admission may take a sibling's computed prompt
    # blocks by reference, so the prompt is computed once even without the prefix cache.
    siblings: list["Sequence"] = field(default_factory=list, repr=False)
    # Structured output: the grammar state (structured_output.GrammarState) the engine advances
    # with every kept token and the runner asks for the next allowed tokens; None when unconstrained.
    grammar_state: Any = None
    # SamplingParams.bad_words as token ids, spelled by the engine's tokenizer at admission
    # (sampling/logits_processors.py bans each word's last token after its others).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # The LoRA adapter (kvflow.lora.LoRARequest) the model runs this sequence with; None: the base model.
    lora_request: Any = None
    # The prefix cache's chain root (kv_cache_manager.hash_block): None for the base model's K/V;
    # an adapter's or a cache_salt's own, so their blocks are found by nobody else.
    hash_root: bytes | None = None
    # An embedding request (kvflow.pooling.PoolingState): its prompt is pooled, nothing is sampled.
    pooling: Any = None

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prefix_cacheable_tokens(self) -> int:
        """How many leading tokens admission may serve from the prefix cache.

        Never the last token: the step must compute it to have logits to sample from. A
        request with prompt_logprobs needs the hidden state of every prompt position whose
        entry it still lacks, and a cached position has none, so its lookup stops where its
        entries stop: nothing at first admission (vLLM's rule: such requests skip the lookup,
        though their blocks are still published for others), its scored prefix after a
        preemption, and no limit once every prompt entry is in.
        """
        limit = self.num_tokens - 1
        if self.pooling is not None:  # MEAN pooling needs every position's hidden state too
            limit = self.pooling.cacheable_limit(self.num_tokens)
        if self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens:
            limit = min(limit, max(len(self.prompt_logprobs) - 1, 0))
        return limit

    @property
    def is_prefill(self) -> bool:
        """More than one token still lacks K/V: the prompt (or a preempted sequence's history)."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        if self.status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH):
            return self.status.value
        return "abort" if self.status == SequenceStatus.FINISHED_ABORTED else None

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) across the prompt/output boundary without building the full list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_index)
