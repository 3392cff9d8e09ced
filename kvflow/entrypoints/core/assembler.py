"""API server side of the engine core link: token ids in, the engine's `RequestOutput`s out.

The engine core runs every request with `detokenize=False` and without its stop strings: it
samples, appends token ids and stops on what needs no text (EOS, stop token ids, a grammar's
end, `max_tokens`, `max_model_len`). `OutputAssembler` turns the core's per-step token deltas
(`wire.OutputDeltas`) back into cumulative outputs, detokenizing each completion with the same
`CompletionText` the in-process engine runs, and applies the stop strings in the engine's own
order of checks, token by token:

1. the token's text is added;
2. if the core finished the completion on this token for EOS, a stop token or its grammar
   ("stop"/"abort"), that wins: the engine checks those before the stop strings;
3. else, past `min_tokens`, a completed stop string ends the completion here ("stop", the
   text cut) and later tokens of the step (speculative drafts) are dropped, as in-process;
4. else a "length" finish of the core stands.

An embedding request has no completions: its one entry is its vector (`decode_pooled`).
A completion that a stop string ended is still running in the core; `Assembled` says what to
abort there (the request, or one sample of an n > 1 request) so its blocks are freed at once.
The cumulative logprob is summed here, over the kept tokens in order, as the engine sums it.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvflow.entrypoints.core import wire
from kvflow.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestMetrics, RequestOutput
from kvflow.pooling.params import PoolingParams
from kvflow.sampling.detokenizer import CompletionText, decode_token, name_tokens
from kvflow.sampling.params import SamplingParams


@dataclass
class _Completion:
    text: CompletionText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    completions: list[_Completion]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_request: Any = None  # the kvflow.lora.LoRARequest it runs with, for its outputs


@dataclass
class Assembled:
    """One core entry, assembled: the output to deliver, and what a stop string ended that the
    core still runs (`abort_request`: all of it; `abort_samples`: these samples of n > 1)."""

    output: RequestOutput
    abort_request: bool = False
    abort_samples: list[int] = field(default_factory=list)


class OutputAssembler:
    """Rebuilds each step's cumulative `RequestOutput` from the core's token deltas (module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        # Each logprob's decoded_token, made here as the text is: the core sends none.
        self._decode_token = functools.lru_cache(maxsize=1 << 16)(functools.partial(decode_token, tokenizer))

    def start(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
              params: SamplingParams | PoolingParams, lora_request: Any = None) -> None:
        if isinstance(params, PoolingParams):
            self._requests[request_id] = _Request(prompt, prompt_token_ids, params, [], lora_request=lora_request)
            return
        logprobs = params.logprobs is not None
        completions = [_Completion(CompletionText(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                  params.stop, params.include_stop_str_in_output),
                                   logprobs=[] if logprobs else None, cumulative_logprob=0.0 if logprobs else None)
                       for _ in range(params.n)]
        self._requests[request_id] = _Request(prompt, prompt_token_ids, params, completions, lora_request=lora_request)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def decode_pooled(self, entry: list) -> PoolingRequestOutput | None:
        """An embedding's one entry as its output; None when the request is no longer followed here."""
        req = self._requests.pop(entry[0], None)
        return None if req is None else wire.decode_pooled(entry, req.prompt, req.prompt_token_ids, req.lora_request)

    def decode(self, entry: list) -> Assembled | None:
        """The output of one core entry; None when the request is no longer followed here (aborted)."""
        rid, core_finished, num_cached, m, comps, prompt_lps = entry
        req = self._requests.get(rid)
        if req is None:
            return None
        prev_len = len(req.completions[0].text.text)
        new_ids: list[int] = []
        stopped_here: list[int] = []
        for index, toks, lps, reason, stop_reason in comps:
            c = req.completions[index]
            if c.finish_reason is not None:  # a stop string ended it already; the core's later tokens are dropped
                continue
            lps = None if lps is None else self._logprobs(lps, req.params)
            kept, by_stop_string = self._add_tokens(c, req.params, toks, lps, reason, stop_reason)
            if index == 0:
                new_ids = toks[:kept]
            if by_stop_string and reason is None:  # the core still runs this sample
                stopped_here.append(index)
        if prompt_lps is not None:
            req.prompt_logprobs = self._logprobs(prompt_lps, req.params)
        finished = all(c.finish_reason is not None for c in req.completions)
        metrics = RequestMetrics(*m)
        if finished:
            self.forget(rid)
            if not core_finished:  # a stop string ended it here: the core has not seen its end
                metrics.last_token_time = metrics.finished_time = time.time()
        outputs = [CompletionOutput(i, c.text.text, list(c.token_ids), c.cumulative_logprob,
                                    None if c.logprobs is None else list(c.logprobs), c.finish_reason, c.stop_reason)
                   for i, c in enumerate(req.completions)]
        single = req.params.n == 1  # new_token_ids/new_text are per-sample notions (as the engine's groups say)
        text = outputs[0].text
        out = RequestOutput(rid, req.prompt, req.prompt_token_ids, outputs, finished, metrics,
                            num_cached_tokens=num_cached, new_token_ids=new_ids if single else [],
                            new_text=(text[prev_len:] if len(text) >= prev_len else "") if single else "",
                            prompt_logprobs=req.prompt_logprobs,
                            lora_request=req.lora_request)
        if finished:
            return Assembled(out, abort_request=not core_finished)
        return Assembled(out, abort_samples=stopped_here)

    def _logprobs(self, entries: list[dict | None], params: SamplingParams) -> list[dict[int, Logprob] | None]:
        """The core's logprob entries as `Logprob`s, their tokens named unless the request asked for no text."""
        out = [wire.decode_logprobs(e) for e in entries]
        if params.detokenize and self.tokenizer is not None:
            name_tokens(out, self._decode_token)
        return out

    @staticmethod
    def _add_tokens(c: _Completion, params: SamplingParams, toks: list[int], lps: list[dict[int, Logprob]] | None,
                    reason: str | None, stop_reason: str | int | None) -> tuple[int, bool]:
        """Append a step's tokens to one completion, in the engine's order of stop checks: how many
        were kept, and whether a stop string ended it."""
        last = len(toks) - 1
        for i, tid in enumerate(toks):
            c.token_ids.append(tid)
            if lps is not None and c.logprobs is not None:
                c.logprobs.append(lps[i])
                c.cumulative_logprob += lps[i][tid].logprob
            if i == last and reason is not None and reason != "length":
                c.text.add_token(tid, stops=reason == "stop")
                break  # EOS, a stop token or the grammar ended it on this token: checked before stop strings
            c.text.add_token(tid)
            if len(c.token_ids) >= params.min_tokens:
                stop = c.text.find_stop()
                if stop is not None:
                    c.finish_reason, c.stop_reason = "stop", stop
                    return i + 1, True
        if reason is not None:
            c.finish_reason, c.stop_reason = reason, stop_reason
        return len(toks), False
