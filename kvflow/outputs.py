"""What a request gives back, named as vLLM names it so callers can switch by one import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: {token_id: logprob} (sampled + top-N)
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    new_token_ids: list[int] = field(default_factory=list)  # produced by the step that returned this
    new_text: str = ""
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first, else
    # {token_id: logprob} with the prompt token and the top-k there (None when not asked).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # kvflow's addition: each prompt token's rank at its position (1 = most likely), None for the first.
    prompt_token_ranks: list[int | None] | None = None
    lora_request: Any = None  # the kvflow.lora.LoRARequest the request ran with; None: the base model


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor, float32 [dimensions]: the pooled (and maybe normalised) hidden states


@dataclass
class PoolingRequestOutput:
    """An embedding request's result (`LLM.encode`), complete when it is returned."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    lora_request: Any = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result: the vector as a list of floats."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.tolist()), out.prompt_token_ids, out.finished)
