"""Embeddings: a prompt's final-norm hidden states pooled into one vector.

An embedding request is a prompt-only sequence. It is scheduled like any prefill (chunked,
batched with generating sequences, preemptible); the runner hands each step's hidden states
here instead of the LM head, and the step that completes the prompt yields the vector and
ends the request. Nothing is sampled and no token is generated.

LAST pools the final prompt position, which every chunking computes, so the prefix cache may
serve all the rest. MEAN needs every position's hidden state: its sum is carried across chunks
in float64 (so that the float32 result does not depend on where chunks were cut), and the
prefix cache may serve only positions already summed (`PoolingState.num_pooled`: none at first
admission, the summed prefix after a preemption, whose recomputed rows are not summed twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import torch
import torch.nn.functional as F

from kvflow.pooling.params import PoolerConfig, PoolingParams


@dataclass
class PoolingState:
    """One embedding request's pooling, kept on its sequence (`Sequence.pooling`)."""

    params: PoolingParams
    config: PoolerConfig
    num_pooled: int = 0  # MEAN: leading prompt positions already in `total`
    total: torch.Tensor | None = field(default=None, repr=False)  # MEAN: float64 [hidden] running sum

    @property
    def normalize(self) -> bool:
        return self.config.normalize if self.params.normalize is None else self.params.normalize

    def cacheable_limit(self, num_tokens: int) -> int:
        """How many leading positions the prefix cache may serve (see the module docstring)."""
        return min(self.num_pooled, num_tokens - 1) if self.config.pooling_type == "MEAN" else num_tokens - 1

    def add_rows(self, rows: torch.Tensor, start: int) -> None:
        """Fold in the hidden states of positions [start, start + len(rows)), skipping any already summed."""
        skip = self.num_pooled - start
        if skip < 0:
            raise AssertionError(f"pooling: a chunk starts at position {start}, past the {self.num_pooled} pooled")
        if skip >= len(rows):
            return
        part = rows[skip:].to(torch.float64).sum(dim=0)
        self.total = part if self.total is None else self.total + part
        self.num_pooled = start + len(rows)

    def finish(self, last_row: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        """The request's vector, float32 on the host."""
        if self.config.pooling_type == "MEAN":
            if self.num_pooled != num_prompt_tokens:
                raise AssertionError(f"pooling: {self.num_pooled} of {num_prompt_tokens} positions summed")
            vector = (self.total / num_prompt_tokens).to(torch.float32)
        else:
            vector = last_row.to(torch.float32)
        if self.params.dimensions is not None:
            vector = vector[: self.params.dimensions]
        if self.normalize:
            vector = F.normalize(vector, p=2.0, dim=-1)
        # A copy of its own: a view would keep the step's whole hidden-state tensor alive for as
        # long as the caller keeps the output (fp32 LAST rows, unnormalised, are views).
        return vector.to("cpu", copy=True)


@dataclass
class PooledOutput:
    """A request whose prompt this step completed, and its vector."""

    seq: Any  # engine.Sequence
    data: torch.Tensor  # float32 [dimensions or hidden_size]


def pool_step(hidden: torch.Tensor, items: Seq[Any], query_start: Seq[int]) -> list[PooledOutput]:
    """Pool this step's rows for every scheduled embedding request (items: the scheduler's
    `ScheduledSequence`s, whose `seq.num_computed_tokens` is still the chunk's first position)."""
    done = []
    for i, item in enumerate(items):
        state: PoolingState | None = item.seq.pooling
        if state is None:
            continue
        rows = hidden[query_start[i]: query_start[i + 1]]
        if state.config.pooling_type == "MEAN":
            state.add_rows(rows, item.seq.num_computed_tokens)
        if item.is_sampled:
            done.append(PooledOutput(item.seq, state.finish(rows[-1], item.seq.num_prompt_tokens)))
    return done
