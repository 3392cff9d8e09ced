"""The token bitmask in the sampler, against cases worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.sampling.bitmask import apply_token_bitmask, unpack_bitmask
from kvflow.sampling.params import SamplingParams
from kvflow.sampling.sampler import Sampler, SamplingMetadata

NEG_INF = float("-inf")


def words(allowed: list[int], vocab: int) -> list[int]:
    """Pack a list of allowed ids by hand: bit t % 32 of word t // 32, as int32 (bit 31 is the sign)."""
    out = [0] * ((vocab + 31) // 32)
    for t in allowed:
        out[t // 32] |= 1 << (t % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in out]


def meta_for(params: list[SamplingParams], vocab: int, mask: tuple[torch.Tensor, torch.Tensor] | None,
             outputs: list[list[int]] | None = None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[0]] * n, outputs or [[] for _ in range(n)],
                                  [torch.Generator().manual_seed(i) for i in range(n)], [], vocab,
                                  token_bitmask=mask)


@pytest.mark.parametrize("byteorder", ["little", "big"])  # the byte-table path and the shifting one
def test_unpack_reads_each_bit_including_the_sign_bit(monkeypatch, byteorder):
    import sys

    monkeypatch.setattr(sys, "byteorder", byteorder)
    vocab = 40  # two words, the second one partly used
    allowed = [0, 5, 31, 32, 39]
    mask = unpack_bitmask(torch.tensor([words(allowed, vocab)], dtype=torch.int32), vocab)
    assert mask.shape == (1, 40)
    assert mask[0].nonzero().flatten().tolist() == allowed
    # -1 (all bits set) allows everything; bits past the vocabulary are dropped
    assert unpack_bitmask(torch.full((1, 2), -1, dtype=torch.int32), vocab).all()


def test_apply_masks_only_the_constrained_rows():
    logits = torch.arange(3 * 40, dtype=torch.float32).view(3, 40)
    bitmask = torch.tensor([words([1, 33], 40)], dtype=torch.int32)
    out = apply_token_bitmask(logits, torch.tensor([1]), bitmask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])  # unconstrained rows untouched
    expected = torch.full((40,), NEG_INF)
    expected[1], expected[33] = logits[1, 1], logits[1, 33]
    assert torch.equal(out[1], expected)
    assert torch.equal(logits, torch.arange(120, dtype=torch.float32).view(3, 40))  # input not modified


def test_greedy_takes_the_best_allowed_token():
    # Row 0's best token is 7 (logit 9) but only 3 and 20 are allowed: 20 (logit 4) beats 3 (logit 2).
    logits = torch.zeros(2, 40)
    logits[0, 7], logits[0, 3], logits[0, 20] = 9.0, 2.0, 4.0
    logits[1, 7] = 9.0  # unconstrained row keeps its argmax
    mask = (torch.tensor([0]), torch.tensor([words([3, 20], 40)], dtype=torch.int32))
    out = Sampler()(logits, meta_for([SamplingParams(temperature=0)] * 2, 40, mask))
    assert out.token_ids == [20, 7]


def test_mask_comes_before_penalties_and_logprobs():
    # Repetition penalty 2 on token 5 (seen in the output): 6.0 -> 3.0, below token 9's 4.0. The mask
    # allows only 5 and 9, so the row's distribution is softmax over (3.0, 4.0): logprob of 9 = -log(1 + e^-1).
    logits = torch.zeros(1, 40)
    logits[0, 5], logits[0, 9], logits[0, 1] = 6.0, 4.0, 50.0  # token 1 is the model's favourite, but banned
    mask = (torch.tensor([0]), torch.tensor([words([5, 9], 40)], dtype=torch.int32))
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=1)]
    out = Sampler()(logits, meta_for(params, 40, mask, outputs=[[5]]))
    assert out.token_ids == [9]
    assert out.logprobs[0][9].logprob == pytest.approx(-math.log1p(math.exp(-1.0)), abs=1e-6)
    assert set(out.logprobs[0]) == {9}


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.5, 1.0), (1.0, 0.5)])
def test_random_draws_stay_inside_the_mask(temperature, top_p):
    torch.manual_seed(0)
    logits = torch.randn(4, 70) * 3
    allowed = [[2, 40, 69], [0], [31, 32, 33], list(range(0, 70, 7))]
    bitmask = torch.tensor([words(a, 70) for a in allowed], dtype=torch.int32)
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=i) for i in range(4)]
    for step in range(50):
        meta = meta_for(params, 70, (torch.arange(4), bitmask))
        out = Sampler()(logits, meta)
        for row, token in enumerate(out.token_ids):
            assert token in allowed[row], f"step {step}: row {row} drew {token}, outside {allowed[row]}"


def test_bitmask_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="int32"):
        unpack_bitmask(torch.zeros(1, 2, dtype=torch.int64), 40)
    with pytest.raises(ValueError, match="too few"):
        unpack_bitmask(torch.zeros(1, 1, dtype=torch.int32), 40)
    with pytest.raises(ValueError, match="constrained rows"):
        apply_token_bitmask(torch.zeros(2, 40), torch.tensor([0, 1]), torch.zeros(1, 2, dtype=torch.int32))
