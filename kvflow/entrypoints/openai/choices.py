"""Responses with many choices: a list of prompts, `n` samples of each, and `echo` with logprobs.

OpenAI's rules, which vLLM follows and clients index by:
- a `/v1/completions` request may carry a list of prompts (strings or token-id lists); each is
  its own engine request, and `n` samples each;
- `choices` are ordered and indexed prompt-major: index = prompt_index * n + sample_index; a
  streamed chunk names the choice it extends by that index;
- usage counts each prompt's tokens once (not once per sample) and every sample's completion;
- `echo` prepends the prompt's text to each of its choices; with `logprobs` the choice's logprobs
  start with the prompt's tokens, scored by the engine's `prompt_logprobs` (the first token has
  no logprob: null, as in OpenAI's and vLLM's answers).

Split from server.py, which keeps the routes; this module does the bookkeeping of many
choices over many engine streams.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, Sequence, TypeVar

from kvflow.entrypoints.openai import protocol as p
from kvflow.outputs import CompletionOutput, Logprob, RequestOutput
from kvflow.sampling.params import SamplingParams

T = TypeVar("T")


def check_best_of(best_of: int | None, n: int) -> None:
    """kvflow returns every sample it draws: best_of may only equal n (OpenAI's default)."""
    if best_of is None or best_of == n:
        return
    if best_of < n:
        raise p.InvalidRequestError(f"best_of must be greater than or equal to n ({n}), got {best_of}",
                                    param="best_of")
    raise p.InvalidRequestError(f"best_of > n is not supported (kvflow returns every sample it draws): "
                                f"best_of={best_of}, n={n}; ask for n={best_of} instead", param="best_of")


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts: one string, one token-id list, or a list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise p.InvalidRequestError("prompt: the prompt is empty", param="prompt")
    for item in prompt:
        if isinstance(item, list) and not item:
            raise p.InvalidRequestError("prompt: a prompt in the list is empty", param="prompt")
    return list(prompt)  # type: ignore[arg-type]


def with_prompt_logprobs(params: SamplingParams, k: int) -> SamplingParams:
    """Params that also score the prompt (top-k per position), for echo with logprobs."""
    if params.prompt_logprobs is not None and params.prompt_logprobs >= k:
        return params
    out = copy.copy(params)
    out.prompt_logprobs = k
    return out


def usage(prompt_lens: Sequence[int], outputs: Sequence[RequestOutput]) -> p.UsageInfo:
    """Each prompt once, every sample's completion, and the prompt tokens the prefix cache served."""
    return p.UsageInfo.of(sum(prompt_lens), sum(len(c.token_ids) for o in outputs for c in o.outputs),
                          sum(o.num_cached_tokens for o in outputs))


class TextDeltas(Protocol):
    def delta(self, text: str, finished: bool) -> str: ...


@dataclass
class ChoiceState:
    """What a streamed choice has sent so far: text (through the server's stop-string-safe
    streamer), tokens, and the text offset its completions logprobs continue from."""

    streamer: TextDeltas
    sent_tokens: int = 0
    text_offset: int = 0
    echoed: bool = False
    done: bool = False

    def advance(self, comp: CompletionOutput) -> tuple[str, list[int], list[dict[int, Logprob]]]:
        """The choice's new text and its new tokens (with their logprobs, when asked) since the last call."""
        if self.done:
            return "", [], []
        self.done = comp.finish_reason is not None
        delta = self.streamer.delta(comp.text, self.done)
        ids = comp.token_ids[self.sent_tokens:]
        lps = (comp.logprobs or [])[self.sent_tokens:]
        self.sent_tokens = len(comp.token_ids)
        return delta, ids, lps


@dataclass
class ChoiceStates:
    """Per (prompt, sample) stream state, and each choice's token count for the usage."""

    n: int
    make_streamer: Callable[[], TextDeltas]
    states: dict[tuple[int, int], ChoiceState] = field(default_factory=dict)

    def get(self, prompt_index: int, sample_index: int) -> ChoiceState:
        key = (prompt_index, sample_index)
        if key not in self.states:
            self.states[key] = ChoiceState(self.make_streamer())
        return self.states[key]

    def index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.n + sample_index

    def completion_tokens(self) -> int:
        return sum(s.sent_tokens for s in self.states.values())


async def submit_all(engine: Any, prefix: str, prompts: list[tuple[str | None, list[int]]],
                     params: list[Any], body: p.OpenAIModel,
                     lora_request: Any = None) -> tuple[str, list[Any]]:
    """Submit one engine request per prompt, with the request's priority, cache_salt,
    kv_transfer_params (on the routes that take it) and LoRA adapter; all or none (a refused
    prompt aborts the others)."""
    transfer = getattr(body, "kv_transfer_params", None)  # /v1/embeddings has none
    if transfer is not None and len(prompts) != 1:
        raise p.InvalidRequestError("kv_transfer_params: only a single prompt can be disaggregated",
                                    param="kv_transfer_params")
    extra: dict[str, Any] = {}  # optional arguments, sent only when set (not every engine takes them)
    if transfer is not None:
        extra["kv_transfer_params"] = transfer
    if lora_request is not None:
        extra["lora_request"] = lora_request
    salt = {"cache_salt": body.cache_salt} if body.cache_salt is not None else {}
    base = f"{prefix}-{uuid.uuid4().hex}"
    streams: list[Any] = []
    try:
        for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
            request_id = base if len(prompts) == 1 else f"{base}-{i}"
            streams.append(await engine.add_request(request_id, {"prompt": text, "prompt_token_ids": ids, **salt}, sp,
                                                    priority=body.priority, **extra))
    except BaseException:
        for stream in streams:
            stream.abort()
        raise
    return base, streams


async def gather_all(waits: list[Awaitable[T]], streams: list[Any]) -> list[T]:
    """Await every prompt's final output; if one fails (or the client leaves) abort them all."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()  # a no-op for the finished ones


async def merged(sources: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the source's position.

    Closing the merge (a client gone, an error) cancels and closes every source, so each
    prompt's engine request is aborted and its blocks freed at once.
    """
    iters = [aiter(s) for s in sources]
    if len(iters) == 1:  # one prompt, the usual request: no task and no wait per token
        try:
            async for item in iters[0]:
                yield 0, item
        finally:
            if hasattr(iters[0], "aclose"):
                await iters[0].aclose()
        return

    def next_of(i: int) -> asyncio.Future:
        async def step() -> T:
            return await anext(iters[i])
        return asyncio.ensure_future(step())

    pending: dict[asyncio.Future, int] = {next_of(i): i for i in range(len(iters))}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[next_of(i)] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iters:
            if hasattr(it, "aclose"):
                await it.aclose()


def merging(sources: list[AsyncIterator[T]]) -> "aclosing[AsyncIterator[tuple[int, T]]]":
    """`async with merging(...) as items:` closes the merge however the consumer leaves."""
    return aclosing(merged(sources))
