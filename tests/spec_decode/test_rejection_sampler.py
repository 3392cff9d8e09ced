"""The rejection sampler against hand-made target and proposer distributions.

Emitted tokens must follow the target p exactly: the first token is distributed as p_1, and
the second, given that the first draft was kept, as p_2 (Leviathan et al. 2023, Theorem 1).
Counts over 20,000 draws are checked with chi-square at p > 0.01, from fixed seeds.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvflow.sampling.params import SamplingParams
from kvflow.sampling.sampler import SamplingMetadata
from kvflow.spec_decode.rejection_sampler import RejectionSampler
from tests.spec_decode.chi_square import goodness_of_fit

V, K, N = 6, 2, 20_000


def _meta(params: SamplingParams, rows: int, outputs: list[list[int]] | None = None) -> SamplingMetadata:
    return SamplingMetadata.build(
        params=[params] * rows, prompt_token_ids=[[0]] * rows, output_token_ids=outputs or [[]] * rows,
        generators=[None] * rows, eos_token_ids=[], vocab_size=V)


def _target_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(K + 1, V, generator=g, dtype=torch.float32) * 1.5


def _law(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What the plain sampler draws from: temperature, then top-k."""
    x = logits / params.temperature
    if params.top_k:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return x.softmax(dim=-1)


def _run(params: SamplingParams, drafts: list[list[int]], draft_probs=None, seed: int = 0):
    torch.manual_seed(seed)
    logits = _target_logits().repeat(len(drafts), 1)
    return RejectionSampler()(logits, _meta(params, logits.shape[0]), drafts, [None] * len(drafts), draft_probs)


def _check_law(results, drafts, p: torch.Tensor) -> None:
    first = Counter(r.token_ids[0] for r in results)
    assert goodness_of_fit([first[t] for t in range(V)], p[0].tolist()) > 0.01
    kept = [r for r, d in zip(results, drafts) if r.num_accepted_tokens >= 1]
    second = Counter(r.token_ids[1] for r in kept)
    assert len(kept) > N // 20
    assert goodness_of_fit([second[t] for t in range(V)], p[1].tolist()) > 0.01


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)])
def test_deterministic_drafts_keep_the_target_law(params):
    p = _law(_target_logits(), params)
    drafts = [[int(p[0].argmax()), int(p[1].argmax())]] * N
    results = _run(params, drafts)
    _check_law(results, drafts, p)
    # A one-hot proposer keeps its first draft with probability p_1(d_1).
    rate = sum(r.num_accepted_tokens >= 1 for r in results) / N
    assert abs(rate - float(p[0, drafts[0][0]])) < 4 * (rate * (1 - rate) / N) ** 0.5


def test_drafts_from_a_proposer_distribution_keep_the_target_law():
    params = SamplingParams(temperature=1.0)
    p = _law(_target_logits(), params)
    q = torch.softmax(torch.randn(K, V, generator=torch.Generator().manual_seed(3)) * 2.0, dim=-1)
    g = torch.Generator().manual_seed(11)
    draws = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], dim=1)
    drafts = draws.tolist()
    results = _run(params, drafts, draft_probs=[q] * N)
    _check_law(results, drafts, p)
    # Theory: P(keep d_1) = sum_x min(p_1(x), q_1(x)).
    rate = sum(r.num_accepted_tokens >= 1 for r in results) / N
    assert abs(rate - float(torch.minimum(p[0], q[0]).sum())) < 0.02


def test_greedy_keeps_drafts_while_they_equal_the_argmax():
    logits = _target_logits()
    target = logits.argmax(dim=-1).tolist()
    other = [(t + 1) % V for t in target]
    cases = [[target[0], target[1]], [target[0], other[1]], [other[0], target[1]]]
    sampler = RejectionSampler()
    params = SamplingParams(temperature=0, logprobs=2)
    results = sampler(logits.repeat(len(cases), 1), _meta(params, 3 * (K + 1)), cases, [None] * 3)
    assert [r.token_ids for r in results] == [target, target[:2], target[:1]]
    assert [r.num_accepted_tokens for r in results] == [2, 1, 0]
    # Logprobs are the target's, row by row, for each emitted token.
    full = results[0]
    assert len(full.logprobs) == 3
    expected = torch.log_softmax(logits, dim=-1)
    for j, lp in enumerate(full.logprobs):
        assert lp[target[j]].logprob == pytest.approx(float(expected[j, target[j]]), abs=1e-6)
        assert lp[target[j]].rank == 1  # greedy: each emitted token is its row's argmax


def test_penalties_see_the_drafts_as_already_generated():
    """Row j's repetition penalty applies to drafts[:j], as one-token-at-a-time decoding would."""
    logits = torch.zeros(2, V)
    logits[:, 2] = 1.0  # token 2 is the argmax of both rows...
    logits[:, 3] = 0.9
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    # ...until row 1 sees the draft 2 as generated output: 1.0 / 2 < 0.9.
    meta = _meta(params, 2, outputs=[[], [2]])
    [result] = RejectionSampler()(logits, meta, [[2]], [None])
    assert result.token_ids == [2, 3]


def test_seeded_sequences_repeat_exactly():
    params = SamplingParams(temperature=1.0, seed=5)
    logits = _target_logits()

    def once():
        gens = [torch.Generator().manual_seed(5) for _ in range(50)]
        drafts = [[1, 2]] * 50
        out = RejectionSampler()(logits.repeat(50, 1), _meta(params, 50 * (K + 1)), drafts, gens)
        return [r.token_ids for r in out]

    first = once()
    assert once() == first
    assert len(set(map(tuple, first))) == 1  # one seed, one stream: every copy draws the same
