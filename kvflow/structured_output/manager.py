"""The engine's side of structured output: compiled grammars (cached), per-sequence state, bitmasks.

Three operations, and nothing else touches the grammar engine:
  compile(params)            the request's constraint -> compiled grammar, cached by
                             `params.cache_key()` (LRU): a second request with the same schema
                             reuses the first one's grammar at once. Thread-safe; two threads
                             asking for the same key compile it once.
  new_state(params)          a `GrammarState` for one sequence: a matcher at the grammar's start
                             that the engine advances with every token the sequence keeps.
  fill_token_bitmask(states) the allowed-token bitmask of a batch's constrained rows, which the
                             sampler applies to their logits (it never sees a grammar).

Where compiling happens (so that it never stalls other requests' steps): the async engine
compiles on a worker thread before it hands the request to the engine thread, whose
`add_request` then finds the grammar in the cache; `LLM.generate` compiles in `add_request`,
before its steps start. xgrammar compiles in C++: in a probe a Python thread
kept running (at a third of its speed, on 2 busy cores) through a 0.36 s compile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.structured_output.backend import StructuredOutputError
from kvflow.structured_output.params import StructuredOutputsParams


@dataclass
class CacheStats:
    """Compiled-grammar cache counters: a hit is a request whose grammar was already compiled (or compiling)."""

    hits: int = 0
    misses: int = 0
    size: int = 0


class GrammarState:
    """One sequence's position in its grammar: advanced token by token, asked for the next allowed set."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the sequence must end."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit t of word t // 32 set = allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row: one bit per token id."""
    return (vocab_size + 31) // 32


def fill_token_bitmask(states: list[GrammarState | None], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, bitmask) for the constrained rows of a batch, None when no row is constrained.

    `rows` [C] long indexes the batch; `bitmask` [C, ceil(V/32)] int32 holds their allowed tokens.
    """
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return None
    bitmask = torch.full((len(rows), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    for j, i in enumerate(rows):
        states[i].fill(bitmask, j)  # type: ignore[union-attr]
    return torch.tensor(rows, dtype=torch.long), bitmask


class StructuredOutputManager:
    """Compiles constraints for one engine's tokenizer and vocabulary, and keeps them in an LRU cache.

    The grammar engine (xgrammar, and the tokenizer's vocabulary table it builds, about a second
    for a 49k vocabulary) is set up on the first structured request, not at engine start.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._backend: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._inflight: dict[tuple, Future] = {}
        self.stats = CacheStats()

    def _get_backend(self) -> Any:
        with self._lock:
            if self._backend is None:
                from kvflow.structured_output.backend import XGrammarBackend

                self._backend = XGrammarBackend(self.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._backend

    def check_servable(self, params: StructuredOutputsParams, speculating: bool) -> None:
        """StructuredOutputError when this engine cannot serve a constraint at all."""
        if speculating:
            raise StructuredOutputError("structured_outputs: not supported together with speculative decoding "
                                        "(the engine runs with a speculative_config); send the request without it "
                                        "or serve without speculation", field=params.kind)
        if self.tokenizer is None:
            raise StructuredOutputError("structured_outputs: this model has no tokenizer, which a grammar needs "
                                        "to map text to tokens", field=params.kind)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params`, from the cache or compiled now (StructuredOutputError if invalid)."""
        key = params.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return self._cache[key]
            future = self._inflight.get(key)
            owner = future is None
            if owner:
                future = self._inflight[key] = Future()
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        if not owner:
            return future.result()
        try:
            compiled = self._get_backend().compile(params)
        except BaseException as exc:  # failures are not cached: the next request gets the same message anew
            with self._lock:
                del self._inflight[key]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._inflight[key]
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.stats.size = len(self._cache)
        future.set_result(compiled)
        return compiled

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A sequence's grammar state at the start of its output (compiling first if needed)."""
        compiled = self.compile(params)
        return GrammarState(self._get_backend().matcher(compiled))


__all__ = ["CacheStats", "GrammarState", "StructuredOutputError", "StructuredOutputManager", "fill_token_bitmask"]
