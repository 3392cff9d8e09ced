"""What a request gives back, named as vLLM names it so callers can switch by one import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position, as vLLM reports it.

    `rank` is the token's place in the position's distribution (1 = most likely): measured for
    the sampled (or prompt) token, the order among the top k for the others. `decoded_token` is
    the token's own text, None when the request ran with `detokenize=False`.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: the sampled token and the top k, by token id (vLLM's names).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: the same, None for the first token, which nothing scores.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None  # per generated token: {token_id: Logprob} (sampled + top-N)
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
    # {token_id: Logprob} with the prompt token (and its rank) and the top-k there (None when not asked).
    prompt_logprobs: PromptLogprobs | None = None
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
