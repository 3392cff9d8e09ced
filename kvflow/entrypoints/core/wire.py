"""What crosses between the API server and the engine core process, in msgpack.

Messages are tuples whose first item names them. The hot path, one message per engine step,
carries every request's output of that step as a *delta*: the engine's `RequestOutput` holds
the whole text and token list so far, which re-sent each step would cost O(n^2) bytes over a
stream; the core sends what is new and the client (`OutputAssembler`) rebuilds the cumulative
output. Text can shrink (a completed stop string is cut off), so text goes as (start, suffix).

Rare messages that carry arbitrary Python objects (the dashboard's `call(fn)`: a module-level
function and its pool snapshot) are pickled inside the msgpack frame. Both ends are this
package in two processes of one user, over a socket in a private directory (mode 0700), so
nothing untrusted is ever unpickled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvflow.engine.llm_engine import EngineStats
from kvflow.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvflow.sampling.params import SamplingParams
from kvflow.spec_decode.speculator import SpecDecodeStats
from kvflow.structured_output.params import StructuredOutputsParams

# client -> core
ADD, ABORT, CALL, SHUTDOWN = "add", "abort", "call", "shutdown"
# core -> client
READY, FAILED, ADDED, ADD_ERROR, OUTPUTS, STATS, CALL_RESULT, DEAD = (
    "ready", "failed", "added", "add_error", "outputs", "stats", "call_result", "dead")


def pack(msg: tuple) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> Any:
    # Logprob maps are keyed by token id: int keys are needed.
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


# ---- sampling params ----------------------------------------------------------------------------
def encode_params(params: SamplingParams) -> dict[str, Any]:
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)}
    so = params.structured_outputs
    if so is not None:
        out["structured_outputs"] = {f.name: getattr(so, f.name) for f in dataclasses.fields(so)}
    return out


def decode_params(data: dict[str, Any]) -> SamplingParams:
    so = data.get("structured_outputs")
    if so is not None:
        data = {**data, "structured_outputs": StructuredOutputsParams(**so)}
    return SamplingParams(**data)


# ---- stats --------------------------------------------------------------------------------------
def encode_stats(stats: EngineStats) -> dict[str, Any]:
    return dataclasses.asdict(stats)


def decode_stats(data: dict[str, Any]) -> EngineStats:
    spec = data.get("spec_decode")
    return EngineStats(**{**data, "spec_decode": SpecDecodeStats(**spec) if spec is not None else None})


# ---- errors -------------------------------------------------------------------------------------
def encode_error(exc: BaseException) -> tuple:
    """(kind, message, extra): enough for the client to raise the same exception class."""
    from kvflow.entrypoints.async_engine import EngineDeadError, EngineOverloadedError, EngineStepError
    from kvflow.structured_output.backend import StructuredOutputError

    if isinstance(exc, EngineOverloadedError):
        return "overloaded", str(exc), [exc.num_waiting, exc.max_waiting, exc.retry_after]
    if isinstance(exc, StructuredOutputError):
        return "structured", str(exc), exc.field
    if isinstance(exc, EngineStepError):
        return "step", str(exc), None
    if isinstance(exc, EngineDeadError):
        return "dead", str(exc), None
    if isinstance(exc, ValueError):
        return "value", str(exc), None
    return "other", f"{type(exc).__name__}: {exc}", None


def decode_error(kind: str, message: str, extra: Any) -> BaseException:
    from kvflow.entrypoints.async_engine import EngineDeadError, EngineOverloadedError, EngineStepError
    from kvflow.structured_output.backend import StructuredOutputError

    if kind == "overloaded":
        return EngineOverloadedError(*extra)
    if kind == "structured":
        return StructuredOutputError(message, extra)
    if kind == "step":
        return EngineStepError(message)
    if kind == "dead":
        return EngineDeadError(message)
    if kind == "value":
        return ValueError(message)
    return RuntimeError(message)


# ---- outputs as deltas --------------------------------------------------------------------------
@dataclass
class _Sent:
    """What the client already has of one completion."""

    text: str = ""
    num_tokens: int = 0
    num_logprobs: int = 0


class OutputDeltas:
    """Core side: turns cumulative `RequestOutput`s into the deltas the client lacks."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, _Sent]] = {}
        self._prompt_logprobs_sent: dict[str, int] = {}  # request -> entries sent (they grow over chunks)

    def encode(self, out: RequestOutput) -> list:
        sent = self._sent.setdefault(out.request_id, {})
        comps = []
        for comp in out.outputs:
            s = sent.setdefault(comp.index, _Sent())
            text_start = len(s.text) if comp.text.startswith(s.text) else 0
            tok_start = s.num_tokens if len(comp.token_ids) >= s.num_tokens else 0
            lps = comp.logprobs
            lp_start = s.num_logprobs if lps is not None and len(lps) >= s.num_logprobs else 0
            comps.append([comp.index, text_start, comp.text[text_start:], tok_start, comp.token_ids[tok_start:],
                          comp.cumulative_logprob, lp_start, None if lps is None else lps[lp_start:],
                          comp.finish_reason, comp.stop_reason])
            s.text, s.num_tokens, s.num_logprobs = comp.text, len(comp.token_ids), len(lps or ())
        prompt_lps = ranks = None
        if out.prompt_logprobs is not None and len(out.prompt_logprobs) != self._prompt_logprobs_sent.get(out.request_id):
            self._prompt_logprobs_sent[out.request_id] = len(out.prompt_logprobs)  # in practice: once, complete
            prompt_lps, ranks = out.prompt_logprobs, out.prompt_token_ranks
        if out.finished:
            self.forget(out.request_id)
        m = out.metrics
        return [out.request_id, out.finished, out.num_cached_tokens, out.new_token_ids, out.new_text,
                [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time,
                 m.num_preemptions], comps, prompt_lps, ranks]

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._prompt_logprobs_sent.pop(request_id, None)


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list | None = None
    prompt_token_ranks: list | None = None


class OutputAssembler:
    """Client side: rebuilds each step's cumulative `RequestOutput` from the core's deltas."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def start(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self._requests[request_id] = _Request(prompt, prompt_token_ids)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def decode(self, entry: list) -> RequestOutput | None:
        rid, finished, num_cached, new_ids, new_text, m, comps, prompt_lps, ranks = entry
        req = self._requests.get(rid)
        if req is None:  # aborted on this side meanwhile
            return None
        outputs = []
        for index, text_start, text, tok_start, toks, cum_lp, lp_start, lps, reason, stop_reason in comps:
            prev = req.completions.get(index)
            if prev is None:
                prev = req.completions[index] = CompletionOutput(index, "", [], None, None)
            prev.text = prev.text[:text_start] + text
            prev.token_ids = prev.token_ids[:tok_start] + toks
            if lps is not None:
                prev.logprobs = (prev.logprobs or [])[:lp_start] + lps
            prev.cumulative_logprob, prev.finish_reason, prev.stop_reason = cum_lp, reason, stop_reason
            outputs.append(CompletionOutput(index, prev.text, prev.token_ids, cum_lp,
                                            prev.logprobs, reason, stop_reason))
        if prompt_lps is not None:
            req.prompt_logprobs, req.prompt_token_ranks = prompt_lps, ranks
        if finished:
            self.forget(rid)
        # The engine answers every sample of a request with n > 1 in each output, in index order.
        return RequestOutput(rid, req.prompt, req.prompt_token_ids, outputs, finished, RequestMetrics(*m),
                             num_cached_tokens=num_cached, new_token_ids=new_ids, new_text=new_text,
                             prompt_logprobs=req.prompt_logprobs, prompt_token_ranks=req.prompt_token_ranks)
