"""Greedy sampling's argmax (csrc/sampling.cpp through `sampler.greedy`): torch.max(dim=-1)'s
index for every row, bit for bit: the first maximum, the first NaN where a row has one, at any
width (the vector body and its scalar tail), and for strided rows."""

from __future__ import annotations

import pytest
import torch

from kvflow.sampling.sampler import greedy


def _expected(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices


@pytest.mark.parametrize("n", [1, 5, 16, 17, 31, 48, 1000, 49152 + 3])
def test_greedy_takes_the_first_maximum(kernels, n):
    g = torch.Generator().manual_seed(n)
    logits = torch.randn(9, n, generator=g)
    # ties: row 1 holds its maximum twice in one lane, row 2 in two lanes, row 3 in the tail too
    top = logits.max() + 1
    for row, places in ((1, (0, 16, 32)), (2, (3, 2)), (3, (n - 1, n // 2, 1))):
        for p in places:
            if p < n:
                logits[row, p] = top
    logits[4] = float("-inf")  # all -inf: index 0
    logits[5, n // 3] = float("nan")  # a NaN wins wherever it is
    logits[6, n - 1] = float("nan")  # ... in the tail too
    if n > 1:
        logits[6, 0] = float("nan")
    logits[7] = 0.0
    logits[7, n - 1] = -0.0  # equal to 0.0: the first stays
    logits[8, :] = torch.arange(n, dtype=torch.float32).flip(0)  # the maximum first
    assert torch.equal(greedy(logits), _expected(logits)), n


def test_greedy_on_strided_rows_and_one_row(kernels):
    wide = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    view = wide[:, :257]  # rows 300 floats apart
    assert view.stride(1) == 1 and view.stride(0) == 300
    assert torch.equal(greedy(view), _expected(view))
    one = torch.randn(1, 49152, generator=torch.Generator().manual_seed(2))
    assert torch.equal(greedy(one), _expected(one))


def test_greedy_falls_back_to_torch_off_the_kernel_path():
    """Other dtypes, 1-D input and rows with a column stride take torch's max, with the same rule."""
    g = torch.Generator().manual_seed(3)
    for logits in (torch.randn(4, 70, generator=g).to(torch.bfloat16), torch.randn(4, 70, generator=g).t(),
                   torch.randn(70, generator=g)):
        assert torch.equal(greedy(logits), _expected(logits))
