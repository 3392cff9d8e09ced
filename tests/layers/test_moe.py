"""csrc/moe.cpp's weighted sum of the experts' outputs, rounding for rounding.

The block's other tests compare it with transformers within a tolerance, which a dropped or
misplaced bf16 rounding passes. Here every expert's output is a small integer, exact in any
summation order and on any GEMM (AMX tiles included), so the only roundings left are the sum's:
each y * w rounded to bf16, each partial sum rounded, the experts in ascending id, then the
shared expert's gated output added last. The expected bits are computed in Python in that order.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.layers.linear import pack_linear_weights
from kvflow.layers.moe import SparseMoeBlock

# 44 columns: the 16-lane loop (and the 8-lane one) and a scalar tail
HIDDEN, EXPERTS, TOP_K, INTER, TOKENS = 44, 8, 4, 8, 29


def _make_exact(mlp, g: torch.Generator) -> None:
    """Gate rows read only column 0 (x's constant 1) with weight 32; up rows -1/0/1 on columns
    1-4; down weights +-1/32 (see _exact_block)."""
    gate = torch.zeros(INTER, HIDDEN)
    gate[:, 0] = 32
    up = torch.zeros(INTER, HIDDEN)
    up[:, 1:5] = torch.randint(-1, 2, (INTER, 4), generator=g).float()
    mlp.gate_up_proj.weight.copy_(torch.cat([gate, up]))
    mlp.down_proj.weight.copy_(torch.randint(-1, 2, (HIDDEN, INTER), generator=g) / 32)


def _exact_block(shared: bool) -> tuple[SparseMoeBlock, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Column 0 of x is 1 and every gate row reads only it with weight 32, so each gate is 32 and
    silu(32) is 32 in float32; up rows are -1/0/1 on columns 1-4 (|up| <= 4), down weights +-1/32:
    an expert's output is an integer of at most 32 in magnitude, exact in bf16. Also each expert's
    (gate_up, down) weights in float64, the shared expert's last (packing repacks the modules')."""
    g = torch.Generator().manual_seed(0)
    block = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, INTER, norm_topk_prob=True, round_weights=True,
                           shared_intermediate_size=INTER if shared else 0)
    with torch.no_grad():
        # exact router logits with no ties: multiples of 1/8, plus e/64 on column 0 for expert e
        router = torch.randint(-4, 5, (EXPERTS, HIDDEN), generator=g) / 8
        router[:, 0] += torch.arange(EXPERTS) / 64
        block.gate.weight.copy_(router)
        for mlp in [*block.experts, *([block.shared_expert] if shared else [])]:
            _make_exact(mlp, g)
        if shared:
            block.shared_expert_gate.weight.zero_()  # sigmoid(0) = 0.5 exactly
    block = block.to(torch.bfloat16)
    mlps = [*block.experts, *([block.shared_expert] if shared else [])]
    weights = [(m.gate_up_proj.weight.double().clone(), m.down_proj.weight.double().clone()) for m in mlps]
    pack_linear_weights(block)
    return block, weights


def _expert_output(weights: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The expert's output in float64 (exact for these weights)."""
    gate_up, down = weights
    act = 32 * (x.double() @ gate_up.T)[:, INTER:]  # silu(32) * up
    return act @ down.T


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with shared expert"])
def test_kernel_rounds_the_weighted_sum_where_the_reference_does(shared):
    block, expert_weights = _exact_block(shared)
    if block.kernel_record() is None:
        pytest.skip("csrc/moe.cpp does not run here (no bf16 kernels)")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-1, 2, (TOKENS, HIDDEN), generator=g).to(torch.bfloat16)
    x[:, 0] = 1
    with torch.no_grad():
        out = block(x)
        weights, ids = block.route(x)
    ids, order = ids.sort(dim=-1)  # each token's experts in ascending id: the order of the sum
    weights = weights.gather(1, order)
    ys = torch.stack([_expert_output(w, x) for w in expert_weights[:EXPERTS]])  # [experts, tokens, hidden]
    assert ys.abs().max() <= 32 and torch.equal(ys, ys.round()), "the experts' outputs are not small integers"
    rows = torch.arange(TOKENS)

    def product(j: int) -> torch.Tensor:  # y * w in float32, rounded to bf16
        return (ys[ids[:, j], rows].float() * weights[:, j].float().unsqueeze(1)).to(torch.bfloat16)

    expected = product(0)
    for j in range(1, TOP_K):
        expected = (expected.float() + product(j).float()).to(torch.bfloat16)
    if shared:
        half = (0.5 * _expert_output(expert_weights[-1], x).float()).to(torch.bfloat16)
        expected = (expected.float() + half.float()).to(torch.bfloat16)
    assert torch.equal(out, expected), f"{(out != expected).sum().item()} of {out.numel()} values differ"


@pytest.mark.parametrize("top_k", [1, 5, 7])
def test_float32_sum_multiplies_then_adds(top_k):
    """In float32 the dtype's rounding does nothing, and GCC would contract `acc + y * w` into one
    FMA, on some columns and some top-k and not others (measured: 327 of 1,276 values at k = 5);
    the reference multiplies, then adds. A zero router with every expert chosen gives each the
    weight 1/k exactly as torch computes it, so the expected sum is plain float32 arithmetic."""
    g = torch.Generator().manual_seed(2)
    block = SparseMoeBlock(HIDDEN, top_k, top_k, INTER, norm_topk_prob=False, round_weights=True)
    with torch.no_grad():
        block.gate.weight.zero_()
        for mlp in block.experts:
            _make_exact(mlp, g)
    weights = [(m.gate_up_proj.weight.double().clone(), m.down_proj.weight.double().clone()) for m in block.experts]
    pack_linear_weights(block)
    if block.kernel_record() is None:
        pytest.skip("csrc/moe.cpp does not run here (no float32 kernels)")
    x = torch.randint(-1, 2, (TOKENS, HIDDEN), generator=g).float()
    x[:, 0] = 1
    with torch.no_grad():
        out = block(x)
    w = torch.softmax(torch.zeros(top_k), dim=0)[0]  # 1/k, as the kernel computes it
    expected = _expert_output(weights[0], x).float() * w
    for e in range(1, top_k):
        expected = expected + _expert_output(weights[e], x).float() * w
    assert torch.equal(out, expected), f"{(out != expected).sum().item()} of {out.numel()} values differ"


def test_larger_steps_after_smaller_ones_reuse_the_buffers_correctly():
    """The block's buffers are kept between calls and grown: a step after a smaller one (and a
    smaller one after it) gives each row what it gives alone."""
    block, _ = _exact_block(False)
    if block.kernel_record() is None:
        pytest.skip("csrc/moe.cpp does not run here (no bf16 kernels)")
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-1, 2, (300, HIDDEN), generator=g).to(torch.bfloat16)
    x[:, 0] = 1
    with torch.no_grad():
        alone = torch.cat([block(x[i: i + 1]) for i in range(8)])
        assert torch.equal(block(x)[:8], alone)
        assert torch.equal(block(x[:8]), alone)
