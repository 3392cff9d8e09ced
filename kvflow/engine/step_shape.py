"""The shape of one engine step: how much work it was, in the units a roofline counts.

`kvflow bench throughput` records one per step (LLMEngine.step_shapes) and `kvflow bench
roofline` turns them into the run's attainable floor: each step takes at least its FLOPs at
the matmul ceiling or its bytes (weights once, plus the K/V its attention reads) at the
memory bandwidth, whichever is longer. A run's schedule, not only its token totals, sets how
close to the compute ceiling it can come: a decode step of three sequences streams every
weight for three tokens' arithmetic.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

from kvflow.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepShape:
    tokens: int  # rows through the decoder layers (prompt chunks, decodes and drafts)
    logits_rows: int  # rows through the LM head: a sampled sequence's last row and its drafts
    attention_pairs: int  # (query, key) pairs attention scores, summed over the step's sequences
    kv_tokens_read: int  # cached tokens whose K/V the step's attention reads, each sequence's once

    def as_list(self) -> list[int]:
        return list(astuple(self))


def step_shape(sched: SchedulerOutput) -> StepShape:
    """The shape of a scheduled batch; call before the step advances num_computed_tokens."""
    tokens = logits = pairs = kv = 0
    for item in sched.scheduled:
        context, new = item.seq.num_computed_tokens, item.num_new_tokens
        tokens += new
        if item.needs_logits:
            logits += 1 + len(item.spec_token_ids)
        pairs += new * context + new * (new + 1) // 2  # causal: query i sees context + i + 1 keys
        kv += context + new
    return StepShape(tokens, logits, pairs, kv)
