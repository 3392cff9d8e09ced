"""Verification: which proposed tokens the target model keeps, and the token it adds.

A speculating sequence arrives with k draft tokens d_1..d_k and k+1 rows of target logits:
row j is the target's next-token distribution p_j after the context plus d_1..d_j, with the
request's own penalties, min_tokens ban, temperature and top-k/top-p/min-p applied exactly as
the plain sampler would (the runner builds the SamplingMetadata of row j as if d_1..d_j had
already been generated).

Greedy rows keep drafts while each equals the target's argmax, then add the argmax of the
first row that disagrees (or of row k+1): the same tokens as decoding one at a time.

Random rows with a draft model use rejection sampling (Leviathan et al. 2023; Chen et al.
2023): d_j is kept with probability min(1, p_j(d_j) / q_j(d_j)), where q_j is the draft's
distribution; the first rejected position draws from the residual max(0, p_j - q_j),
renormalised, and a fully accepted run draws one bonus token from p_{k+1}. Every emitted
token is then distributed exactly as p.

A deterministic proposer (n-gram lookup) has q_j = one-hot(d_j), and then rejection sampling
is the same as sampling first and comparing: draw t_j from p_j, keep d_j if t_j == d_j, else
emit t_j and stop (t_j is then distributed as p_j without d_j, the residual). Drawn that way,
row by row with the same Exp(1) race the plain sampler uses, a seeded request consumes its
generator exactly as decoding one token at a time does, so its output is the same with
speculation on or off, whatever shares the batch. With a draft model a seeded request is
reproducible run to run, but its stream differs from plain decoding (k uniforms per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.outputs import Logprob
from kvflow.sampling.sampler import (
    SamplingMetadata,
    apply_logits_processors,
    exponential_race,
    filter_logits,
    gather_logprobs,
    greedy,
)


@dataclass
class VerifiedTokens:
    """One speculating sequence's result: accepted drafts, then one token from the target."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None  # target logprobs of each emitted token, when asked
    num_draft_tokens: int
    num_accepted_tokens: int


class RejectionSampler:
    def __call__(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        draft_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> list[VerifiedTokens]:
        """`logits` has len(drafts)+1 rows per sequence, sequences in order; `meta` one row per logits row.

        `draft_probs[i]` is [k_i, V], the proposer's (filtered) distribution for each draft,
        or None for a deterministic proposer.
        """
        num_rows = sum(len(d) + 1 for d in draft_token_ids)
        if logits.shape[0] != num_rows or meta.num_rows != num_rows:
            raise ValueError(f"rejection sampler: {logits.shape[0]} logits rows and {meta.num_rows} metadata rows "
                             f"for {num_rows} (drafts + 1 per sequence)")
        scores = apply_logits_processors(logits, meta)
        targets = greedy(scores).tolist()
        random_pos: dict[int, int] = {}
        filtered = probs = None
        if meta.random_rows is not None:
            random_pos = {row: i for i, row in enumerate(meta.random_rows.tolist())}
            filtered = filter_logits(scores[meta.random_rows], meta)
            if draft_probs is not None and any(q is not None for q in draft_probs):
                probs = filtered.softmax(dim=-1)  # once for the batch: small per-row ops cost more than the math

        results, emitted_rows, emitted_tokens = [], [], []
        offset = 0
        for i, drafts in enumerate(draft_token_ids):
            k = len(drafts)
            if offset in random_pos:
                start = random_pos[offset]
                q = draft_probs[i] if draft_probs is not None else None
                rows = slice(start, start + k + 1)
                tokens = _verify_random(filtered[rows], probs[rows] if q is not None else None, drafts, q,
                                        generators[i])
            else:
                tokens = verify_greedy(targets[offset : offset + k + 1], drafts)
            results.append(VerifiedTokens(tokens, None, k, len(tokens) - 1))
            if meta.num_logprobs[offset] is not None:
                emitted_rows.extend(range(offset, offset + len(tokens)))
                emitted_tokens.extend(tokens)
            offset += k + 1

        if emitted_rows:
            rows = torch.tensor(emitted_rows, dtype=torch.long)
            logprobs = gather_logprobs(scores[rows], torch.tensor(emitted_tokens, dtype=torch.long),
                                       [meta.num_logprobs[r] for r in emitted_rows])
            offset = cursor = 0
            for result, drafts in zip(results, draft_token_ids):
                if meta.num_logprobs[offset] is not None:
                    n = len(result.token_ids)
                    result.logprobs = logprobs[cursor : cursor + n]
                    cursor += n
                offset += len(drafts) + 1
        return results


def verify_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]


def _verify_random(
    x: torch.Tensor, p: torch.Tensor | None, drafts: list[int], q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """One sequence's k+1 rows of filtered target logits `x` (p = softmax(x)); q None: one-hot drafts."""
    k = len(drafts)
    if q is None:  # sample, then compare: exact for a one-hot proposal, and the plain sampler's stream
        emitted = []
        for j in range(k + 1):
            emitted.append(exponential_race(x[j], generator))
            if j == k or emitted[-1] != drafts[j]:
                return emitted
    draft_index = torch.tensor(drafts, dtype=torch.long)
    p_draft = p[torch.arange(k), draft_index]
    q_draft = q[torch.arange(k), draft_index]
    accept_prob = torch.where(q_draft > 0, p_draft / q_draft, torch.ones_like(p_draft)).clamp(max=1.0)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float32)
    accepted = (uniforms < accept_prob).tolist()
    for j in range(k):
        if accepted[j]:
            continue
        mass = (p[j] - q[j]).clamp(min=0)
        # p == q up to rounding leaves no residual mass; then p itself is the right law.
        residual = mass.log() if float(mass.sum()) > 0 else x[j]
        return drafts[:j] + [exponential_race(residual, generator)]
    return drafts + [exponential_race(x[k], generator)]
