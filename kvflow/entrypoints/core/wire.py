"""What crosses between the API server and the engine core process, in msgpack.

Messages are tuples whose first item names them. The hot path, one message per engine step,
carries every request's output of that step as a *delta*: the engine's `RequestOutput` holds
the whole token list so far, which re-sent each step would cost O(n^2) bytes over a stream; the
core sends the new token ids (and logprobs) with the finish reason of EOS, stop tokens and
`max_tokens`, and the client (`assembler.OutputAssembler`) detokenizes them, matches the stop
strings and rebuilds the cumulative output. No text crosses: the core never detokenizes. An
embedding request's one output is its vector, as float32 bytes (`encode_pooled`).

Rare messages that carry arbitrary Python objects (the dashboard's `call(fn)`: a module-level
function and its pool snapshot) are pickled inside the msgpack frame. Both ends are this
package in two processes of one user, over a socket in a private directory (mode 0700), so
nothing untrusted is ever unpickled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from kvflow.engine.llm_engine import EngineStats
from kvflow.lora.request import LoRARequest
from kvflow.outputs import Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from kvflow.pooling.params import PoolingParams
from kvflow.sampling.params import SamplingParams
from kvflow.spec_decode.speculator import SpecDecodeStats
from kvflow.structured_output.params import StructuredOutputsParams

# client -> core
ADD, ABORT, ABORT_SAMPLE, CALL, SHUTDOWN = "add", "abort", "abort_sample", "call", "shutdown"
# core -> client
READY, FAILED, ADDED, ADD_ERROR, OUTPUTS, STATS, CALL_RESULT, DEAD = (
    "ready", "failed", "added", "add_error", "outputs", "stats", "call_result", "dead")


def pack(msg: tuple) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> Any:
    # Logprob maps are keyed by token id: int keys are needed.
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


# ---- sampling and pooling params ----------------------------------------------------------------
def encode_params(params: SamplingParams | PoolingParams) -> dict[str, Any]:
    if isinstance(params, PoolingParams):
        return {"pooling": dataclasses.asdict(params)}
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)}
    so = params.structured_outputs
    if so is not None:
        out["structured_outputs"] = {f.name: getattr(so, f.name) for f in dataclasses.fields(so)}
    return out


def decode_params(data: dict[str, Any]) -> SamplingParams | PoolingParams:
    if "pooling" in data:
        return PoolingParams(**data["pooling"])
    so = data.get("structured_outputs")
    if so is not None:
        data = {**data, "structured_outputs": StructuredOutputsParams(**so)}
    return SamplingParams(**data)


def encode_lora(request: LoRARequest | None) -> list | None:
    return None if request is None else [request.lora_name, request.lora_int_id, request.lora_path]


def decode_lora(data: list | None) -> LoRARequest | None:
    return None if data is None else LoRARequest(*data)


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

    num_tokens: int = 0
    num_logprobs: int = 0


class OutputDeltas:
    """Core side: turns cumulative `RequestOutput`s into the new token ids (and logprobs) the client
    lacks. No text: the core runs with `detokenize=False`, the API process makes the text."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, _Sent]] = {}
        self._prompt_logprobs_sent: dict[str, int] = {}  # request -> entries sent (they grow over chunks)

    def encode(self, out: RequestOutput) -> list:
        sent = self._sent.setdefault(out.request_id, {})
        comps = []
        for comp in out.outputs:
            s = sent.setdefault(comp.index, _Sent())
            lps = comp.logprobs  # output tokens and their logprobs only ever grow
            comps.append([comp.index, comp.token_ids[s.num_tokens:],
                          None if lps is None else [encode_logprobs(e) for e in lps[s.num_logprobs:]],
                          comp.finish_reason, comp.stop_reason])
            s.num_tokens, s.num_logprobs = len(comp.token_ids), len(lps or ())
        prompt_lps = None
        if out.prompt_logprobs is not None and len(out.prompt_logprobs) != self._prompt_logprobs_sent.get(out.request_id):
            self._prompt_logprobs_sent[out.request_id] = len(out.prompt_logprobs)  # in practice: once, complete
            prompt_lps = [encode_logprobs(e) for e in out.prompt_logprobs]
        if out.finished:
            self.forget(out.request_id)
        return [out.request_id, out.finished, out.num_cached_tokens, _encode_metrics(out.metrics), comps, prompt_lps]

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._prompt_logprobs_sent.pop(request_id, None)


def encode_logprobs(entry: dict[int, Logprob] | None) -> dict[int, list] | None:
    """{token id: [logprob, rank]}: the core never detokenizes, so no decoded_token crosses."""
    return None if entry is None else {t: [lp.logprob, lp.rank] for t, lp in entry.items()}


def decode_logprobs(entry: dict[int, list] | None) -> dict[int, Logprob] | None:
    return None if entry is None else {t: Logprob(lp, rank) for t, (lp, rank) in entry.items()}


def _encode_metrics(m: RequestMetrics) -> list:
    return [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time,
            m.num_preemptions]


# ---- an embedding's vector ----------------------------------------------------------------------
POOLED = "pooled"  # the tag that ends an embedding's entry


def encode_pooled(out: PoolingRequestOutput) -> list:
    """[request_id, num_cached_tokens, metrics, float32 bytes, POOLED] (a token delta has six
    items, the last a list or None; an error four)."""
    data = out.outputs.data.numpy().astype("<f4").tobytes()
    return [out.request_id, out.num_cached_tokens, _encode_metrics(out.metrics), data, POOLED]


def is_pooled(entry: list) -> bool:
    return len(entry) == 5 and entry[4] == POOLED


def decode_pooled(entry: list, prompt: str | None, prompt_token_ids: list[int],
                  lora_request: LoRARequest | None = None) -> PoolingRequestOutput:
    rid, num_cached, metrics, data, _ = entry
    vector = torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())
    return PoolingRequestOutput(rid, PoolingOutput(vector), prompt_token_ids, True, prompt=prompt,
                                num_cached_tokens=num_cached, metrics=RequestMetrics(*metrics),
                                lora_request=lora_request)
