"""Log-probabilities in the wire formats: completions', chat's, and vLLM's prompt_logprobs.

The engine gives, per generated (or prompt) position, `{token id: Logprob}` for the chosen token
and the top k. These functions turn those into what each route sends; the server decodes each
token once (`decode`, cached by the server; it also names tokens of a model without a tokenizer).
"""

from __future__ import annotations

from typing import Callable

from kvflow.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from kvflow.outputs import Logprob

TokenDecoder = Callable[[int], str]
# What a logprob of -inf (a token the grammar, allowed_token_ids or a ban ruled out) is sent as:
# JSON has no -inf, and vLLM sends this.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, LOGPROB_FLOOR)


def top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one step (the engine adds the sampled one when outside them)."""
    return [(t, finite(lp.logprob)) for t, lp in sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:k]]


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None], k: int, decode: TokenDecoder,
                        offset: int = 0) -> CompletionLogProbs:
    """The legacy completions shape: parallel lists, text_offset counted in characters. Each
    position's top_logprobs holds the k most likely tokens and the chosen one, so up to k + 1
    (OpenAI's rule, and vLLM's; with logprobs=0 the chosen token alone).

    A None entry (an echoed prompt's first token, which nothing scores) gives nulls, as OpenAI answers.
    """
    out = CompletionLogProbs()
    for tid, entry in zip(token_ids, logprobs):
        token = decode(tid)
        out.tokens.append(token)
        chosen = None if entry is None else entry.get(tid)
        out.token_logprobs.append(None if chosen is None else finite(chosen.logprob))
        if entry is None:
            out.top_logprobs.append(None)
        else:
            tops = {decode(t): lp for t, lp in top_logprobs(entry, k)}
            if chosen is not None:
                tops.setdefault(token, finite(chosen.logprob))
            out.top_logprobs.append(tops)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def echo_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None] | None, k: int,
                  decode: TokenDecoder) -> CompletionLogProbs:
    """The prompt's part of an echoed choice's logprobs (the engine's prompt_logprobs)."""
    return completion_logprobs(token_ids, entries or [None] * len(token_ids), k, decode)


def joined(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens, top_logprobs=first.top_logprobs + second.top_logprobs)


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], k: int, decode: TokenDecoder,
                  to_bytes: Callable[[int], bytes]) -> ChatLogprobs:
    """The chat shape: one object per token, with its own bytes (loader.tokenizer.token_bytes: part
    of a character where the token is) and its top alternatives."""
    content = []
    for tid, entry in zip(token_ids, logprobs):
        tops = [TopLogprob(token=decode(t), logprob=lp, bytes=list(to_bytes(t))) for t, lp in top_logprobs(entry, k)]
        chosen = entry.get(tid)
        logprob = LOGPROB_FLOOR if chosen is None else finite(chosen.logprob)
        content.append(ChatLogprobToken(token=decode(tid), logprob=logprob,
                                        bytes=list(to_bytes(tid)), top_logprobs=tops))
    return ChatLogprobs(content=content)


def prompt_logprobs(logprobs: list[dict[int, Logprob] | None], decode: TokenDecoder) -> PromptLogprobs:
    """vLLM's prompt_logprobs: {token id: {logprob, rank, decoded_token}} per position, None first.

    The prompt token keeps the rank the engine measured (past the top-k when it is not among
    them), the top-k their order; -inf is sent as LOGPROB_FLOOR.
    """
    return [None if entry is None else
            {str(t): PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank, decoded_token=decode(t))
             for t, lp in entry.items()}
            for entry in logprobs]
