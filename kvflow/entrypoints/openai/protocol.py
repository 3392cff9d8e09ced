"""The OpenAI wire format: request and response models, and their mapping to SamplingParams.

Requests accept OpenAI's fields plus vLLM's sampling extensions (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, ...) and ignore unknown fields, as both servers
do, so clients written for either work unchanged. Responses are built from these models so
that the JSON shape (including the `null`s clients key on) is defined in one place.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Callable, ClassVar, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from kvflow.config import INT64_MAX, INT64_MIN
from kvflow.entrypoints.openai.structured import StructuredOutputFields
from kvflow.entrypoints.openai.tool_calls import DeltaToolCall, ToolCall, ToolFields, template_message_tool_calls
from kvflow.sampling.params import MAX_LOGPROBS, SamplingParams
from kvflow.structured_output.params import StructuredOutputsParams


class InvalidRequestError(ValueError):
    """A request the server understood but cannot serve (HTTP 400, or `status`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


# A token id as a request may send one: no model has 2**31 tokens, and a bound keeps absurd
# integers from reaching msgpack (the split server's wire), which cannot pack them.
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- requests -------------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far on every chunk too


class SamplingRequest(OpenAIModel, StructuredOutputFields):
    """Fields shared by /v1/completions and /v1/chat/completions (and response_format/structured_outputs)."""

    absent_max_tokens: ClassVar[int | None] = None  # chat: until the context is full, as in vLLM
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # OpenAI's: token id (a string of digits) -> bias; vLLM's allowed_token_ids and bad_words.
    logit_bias: dict[Annotated[str, Field(pattern=r"^\d{1,10}$")], Annotated[float, Field(ge=-100, le=100)]] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[Annotated[str, Field(pattern=r"\S")]] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] = 0
    prompt_logprobs: int | None = None  # vLLM's extension: score the prompt's own tokens
    # vLLM's field for prefill/decode disaggregation, set by `kvflow router --prefill/--decode`
    # (do_remote_decode for the prefill instance; do_remote_prefill + remote_kv_addr for the decode one).
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: salts the prefix cache's hashes, so only requests with the same salt share cached K/V
    # (a tenant's prompts cannot be probed by another's timing).
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    use_beam_search: bool = False  # vLLM's: `n` beams by beam search (openai/beam_search.py)
    length_penalty: float = 1.0  # beam search: the score is cum logprob / length ** length_penalty

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        raise NotImplementedError

    def to_sampling_params(self, prompt_len: int, max_model_len: int,
                           defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """SamplingParams for a prompt of `prompt_len` tokens, or InvalidRequestError/ValueError.

        A field the request leaves out (or sends as null) takes the model's sampling default
        from `defaults` (generation_config), else SamplingParams' own. An absent max_tokens
        means the least of the room left, `absent_max_tokens` (completions: 16) and the model's
        default max_tokens, as in vLLM (an explicit null, and chat, skip the 16);
        an explicit one that cannot fit next to the prompt is refused up front with both
        numbers, rather than silently truncated.
        """
        defaults = defaults or {}
        room = max_model_len - prompt_len
        if room < 1:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens, but the prompt is "
                f"{prompt_len} tokens (the prompt plus at least one generated token must fit).",
                param="prompt" if hasattr(self, "prompt") else "messages",
                code="context_length_exceeded",
            )
        max_tokens = self.requested_max_tokens()
        name = "max_completion_tokens" if getattr(self, "max_completion_tokens", None) is not None else "max_tokens"
        if max_tokens is None:
            absent = self.absent_max_tokens if "max_tokens" not in self.model_fields_set else None
            max_tokens = min(v for v in (room, absent, defaults.get("max_tokens")) if v)
        elif max_tokens < 1:
            raise InvalidRequestError(f"{name} must be at least 1, got {max_tokens}", param=name)
        elif max_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or of max_tokens.",
                param=name,
                code="context_length_exceeded",
            )
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        chosen = {k: v if v is not None else defaults.get(k) for k, v in optional.items()}  # request > model
        if self.stream and self.prompt_logprobs is not None and self.prompt_logprobs != 0:  # as vLLM
            raise InvalidRequestError("`prompt_logprobs` are not available when `stream=True`.",
                                      param="prompt_logprobs")
        return SamplingParams(
            n=1 if self.n is None else self.n,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            prompt_logprobs=None if self.stream and self.prompt_logprobs == 0 else self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_output_params(),
            logit_bias=self.logit_bias or None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            **{k: v for k, v in chosen.items() if v is not None},
        )


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]  # one prompt or a batch (choices.prompt_list)
    absent_max_tokens: ClassVar[int | None] = 16  # OpenAI's and vLLM's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None  # only None or n: every sample drawn is returned (choices.check_best_of)

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools

    def to_template_dict(self) -> dict[str, Any]:
        """The dict a chat template expects: text parts joined, `developer` read as `system`."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = template_message_tool_calls(self.tool_calls)
        return message


class ChatCompletionRequest(SamplingRequest, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply continues the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def structured_output_field(self) -> str | None:
        forcing = self.tools and self.tool_choice not in (None, "none", "auto")
        return "tool_choice" if forcing else super().structured_output_field

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """A forced tool call's constraint (tool_calls.py), else response_format's or structured_outputs'."""
        forced = self.forced_call()
        if forced is None:
            return super().structured_output_params()
        if super().structured_output_field is not None:
            raise InvalidRequestError(f"give either a forced tool_choice or {super().structured_output_field}, "
                                      "not both", param="tool_choice")
        return forced.constraint()

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:  # named as sent
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                                      param="top_logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


# ---- responses ------------------------------------------------------------------------------
class PromptTokensDetails(OpenAIModel):
    cached_tokens: int  # prompt tokens whose K/V the prefix cache served


class UsageInfo(OpenAIModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # in final usage (OpenAI's field), not per chunk

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> "UsageInfo":
        details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptLogprob(OpenAIModel):
    """One token's score at one prompt position, as vLLM's server sends its `Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt token; None for the first


class CompletionResponseChoice(CompletionChoice):
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's place for them: on the choice


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(OpenAIModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's place for them in chat: the response


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """A delta carries only what changed: {"content": "..."}, never {"role": null}."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvflow"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    # kvflow's extension: what fills a request's unset sampling fields, and where it came from.
    sampling_defaults: dict[str, Any] = Field(default_factory=dict)
    sampling_defaults_source: str | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
