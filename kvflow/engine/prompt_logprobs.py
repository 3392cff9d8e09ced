"""Prompt logprobs: how likely the model found each token of the prompt, computed at prefill.

vLLM's `SamplingParams(prompt_logprobs=k)`, which evaluation harnesses use for perplexity
and for scoring continuations. Entry i of a request's list scores prompt token i under the
model's distribution at position i - 1, plus the k most likely tokens there; entry 0 is None
(nothing precedes the first token). The distribution is the log-softmax of the raw float32
logits, before penalties and temperature, as vLLM's default "raw" mode and as the sampler
reports generated tokens' logprobs (`gather_logprobs` computes both).

Normally only the last row of a chunk goes through the LM head. For a request that asks,
every prompt row of its chunk whose entry is still missing goes through it too, in slices of
`SLICE_ROWS` rows: full-vocabulary logits of a 2048-token chunk would be 2048 x 49152
float32 (400 MB) at once, a slice of 256 is 50 MB. Each entry is computed exactly once: the
rows start at the first missing entry, so a chunk recomputed after a preemption appends
nothing twice, and admission serves such a request from the prefix cache only as far as its
entries already reach (`Sequence.num_prefix_cacheable_tokens`), since a cached position has
no hidden state to score from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import torch

from kvflow.engine.scheduler import ScheduledSequence
from kvflow.engine.sequence import Sequence
from kvflow.outputs import Logprob
from kvflow.sampling.detokenizer import name_tokens
from kvflow.sampling.sampler import gather_logprobs

SLICE_ROWS = 256  # LM-head rows per slice: bounds the float32 logits held at once to SLICE_ROWS x vocab


@dataclass
class PromptLogprobChunk:
    """The prompt logprob entries one step produced for one sequence, to append in order."""

    seq: Sequence
    logprobs: list[dict[int, Logprob] | None]  # {token_id: Logprob}: the prompt token (with its rank) and the top-k

    def append_to_sequence(self, decode: Callable[[int], str] | None) -> None:
        """Append the entries, naming each token with `decode` (None: the request does not detokenize)."""
        if decode is not None:
            name_tokens(self.logprobs, decode)
        self.seq.prompt_logprobs.extend(self.logprobs)


@dataclass
class _Span:
    """Rows [row, row + num_rows) of the flat batch score prompt tokens first + 1 .. first + num_rows."""

    seq: Sequence
    row: int
    first: int  # prompt position of the span's first row
    num_rows: int
    leading_none: bool  # the chunk starts the prompt: entry 0 (None) comes first


def plan_spans(items: Seq[ScheduledSequence], query_start: Seq[int]) -> list[_Span]:
    """Which rows of this step's flat batch need scoring, per sequence that asked.

    A chunk over positions [start, end) can score prompt tokens start + 1 .. end (the row at
    position q predicts token q + 1), limited to the prompt and to entries not yet recorded.
    """
    spans = []
    for i, item in enumerate(items):
        seq = item.seq
        done = len(seq.prompt_logprobs)
        if seq.params.prompt_logprobs is None or done >= seq.num_prompt_tokens:
            continue
        start = seq.num_computed_tokens
        end = start + item.num_new_tokens - len(item.spec_token_ids)
        first = max(start, done - 1)  # the row that scores entry `done`
        if first > max(done - 1, 0):
            raise AssertionError(
                f"{seq.request_id}: chunk starts at position {start}, past its prompt logprobs ({done} entries)"
            )
        last = min(end, seq.num_prompt_tokens - 1)  # the prompt's last row predicts the first output token
        if last > first or done == 0:
            spans.append(_Span(seq, query_start[i] + first - start, first, max(last - first, 0), done == 0))
    return spans


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    items: Seq[ScheduledSequence],
    query_start: Seq[int],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    slice_rows: int | None = None,
) -> list[PromptLogprobChunk]:
    """This step's new prompt logprob entries, from the hidden states of the whole flat batch.

    `compute_logits` runs on at most `slice_rows` rows (default `SLICE_ROWS`) at a time.
    """
    if not any(item.seq.params.prompt_logprobs is not None for item in items):
        return []
    slice_rows = slice_rows or SLICE_ROWS
    spans = plan_spans(items, query_start)
    rows = [r for s in spans for r in range(s.row, s.row + s.num_rows)]
    targets = [t for s in spans for t in s.seq.prompt_token_ids[s.first + 1 : s.first + 1 + s.num_rows]]
    ks = [s.seq.params.prompt_logprobs for s in spans for _ in range(s.num_rows)]
    entries: list[dict[int, Logprob] | None] = []
    for lo in range(0, len(rows), slice_rows):
        index = torch.tensor(rows[lo : lo + slice_rows], dtype=torch.long, device=hidden.device)
        logits = compute_logits(hidden[index])
        chosen = torch.tensor(targets[lo : lo + slice_rows], dtype=torch.long, device=logits.device)
        entries.extend(gather_logprobs(logits, chosen, ks[lo : lo + slice_rows]))
        del logits
    out, at = [], 0
    for s in spans:
        head: list = [None] if s.leading_none else []
        out.append(PromptLogprobChunk(s.seq, head + entries[at : at + s.num_rows]))
        at += s.num_rows
    return out
