"""What the engine keeps per request besides its `Sequence`, and the records it hands out.

`RequestState` is one sample's bookkeeping in the engine (its detokenized text and stop
strings, the tokens and text new since the last output, its place in an n > 1 request);
`make_output` turns it into the `RequestOutput` that `LLM` and the server return each step;
`EngineStats` is the counters snapshot behind `/metrics` and `kvflow bench`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.engine.parallel_sampling import SampleGroup
from kvflow.engine.sequence import Sequence
from kvflow.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from kvflow.sampling.detokenizer import CompletionText
from kvflow.spec_decode.speculator import SpecDecodeStats


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_tokens: int = 0
    prefill_tokens: int = 0  # prompt positions computed (prefix hits and shared samples excluded)
    spec_decode: SpecDecodeStats | None = None  # None when speculative decoding is off


@dataclass
class RequestState:
    seq: Sequence
    output: CompletionText  # the detokenized text and the stop strings (shared with the split server's API side)
    cumulative_logprob: float = 0.0
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    group: SampleGroup | None = field(default=None, repr=False)  # n > 1: the request this sample belongs to
    index: int = 0  # the sample's index in the request


def make_output(req: RequestState) -> RequestOutput:
    """The request's output so far, in vLLM's shape (text, tokens, logprobs, metrics)."""
    seq = req.seq
    completion = CompletionOutput(
        index=0,
        text=req.output.text,
        token_ids=list(seq.output_token_ids),
        cumulative_logprob=req.cumulative_logprob if seq.params.logprobs is not None else None,
        logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        outputs=[completion],
        finished=seq.is_finished,
        metrics=_metrics(seq),
        num_cached_tokens=max(seq.num_cached_tokens, 0),
        new_token_ids=req.new_token_ids,
        new_text=req.new_text,
        prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
        lora_request=seq.lora_request,
    )


def make_pooling_output(seq: Sequence, data: torch.Tensor) -> PoolingRequestOutput:
    """An embedding request's one and final output."""
    return PoolingRequestOutput(seq.request_id, PoolingOutput(data), seq.prompt_token_ids, True, prompt=seq.prompt,
                                num_cached_tokens=max(seq.num_cached_tokens, 0), metrics=_metrics(seq),
                                lora_request=seq.lora_request)


def _metrics(seq: Sequence) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=seq.arrival_time,
        first_scheduled_time=seq.first_scheduled_time,
        first_token_time=seq.first_token_time,
        # when the latest token came out, not when this record was made (that came after finished_time)
        last_token_time=seq.last_token_time if seq.last_token_time is not None else seq.first_token_time,
        finished_time=seq.finished_time,
        num_preemptions=seq.num_preemptions,
    )
