"""A pipeline stage's fused C++ stack (its layer range in one call) against the modules.

Two stages of a 4-layer Llama, built as the workers build them (trimmed ends, renumbered
layers), run in this process without torch.distributed: the pair (x, residual) handed from
stage 0 to stage 1, the final hidden states and the KV caches must equal the per-module path
bit for bit, whichever path each stage takes.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvflow.distributed.config import ParallelConfig
from kvflow.distributed.layers import shard_weights
from kvflow.distributed.worker import _trim_for_rank
from kvflow.layers.attention import CPUAttentionBackend
from kvflow.loader import load_model, load_model_config
from kvflow.models.llama_fused import FusedLlamaStack
from tests.models.test_llama_fused import BLOCK, STEPS, _step

NUM_BLOCKS = 12


def _stages(path: str, dtype: torch.dtype):
    cfg, parallel = load_model_config(path), ParallelConfig(1, 2, "mp")
    stages = []
    for rank in range(2):
        model = load_model(path, parallel.rank_model_config(cfg, rank), dtype, CPUAttentionBackend(),
                           adapt_model=_trim_for_rank(parallel, rank, cfg.tie_word_embeddings),
                           adapt_weights=lambda w, r=rank: shard_weights(w, cfg, parallel, r), fuse_stack=False)
        stages.append((model, FusedLlamaStack.build(model)))
    return cfg, stages


def _run(cfg, stages, fused_on: tuple[bool, bool], ids, positions, meta, caches):
    """Stage 0 then stage 1, each fused or on its modules; the pair between them and the final hidden."""
    (m0, f0), (m1, f1) = stages
    x = m0.embed_tokens(ids)
    out = f0.run_stage(x, None, positions, caches[0], meta) if fused_on[0] else None
    if out is not None:
        pair = (out, x)
    else:
        x, residual = x, None
        for layer, c in zip(m0.layers, caches[0]):
            x, residual = layer(positions, x, residual, c, meta)
        pair = (x, residual)
    x, residual = pair[0].clone(), pair[1].clone()
    if fused_on[1]:
        hidden = f1.run_stage(residual, x, positions, caches[1], meta)
        assert hidden is not None, "stage 1 fell back to the modules"
    else:
        for layer, c in zip(m1.layers, caches[1]):
            x, residual = layer(positions, x, residual, c, meta)
        hidden = m1.norm(x, residual)[0]
    return pair, hidden


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_stages_equal_the_modules_bitwise(tiny_gqa, kernels, dtype):
    if not kernels.has_gemm(dtype):
        pytest.skip(f"this CPU lacks the instructions of kvflow's {dtype} GEMM")
    cfg, stages = _stages(tiny_gqa[0], dtype)
    assert all(f is not None for _, f in stages), "the fused stack should apply to both stages"
    assert stages[0][0].norm is None and stages[1][0].embed_tokens is None  # really trimmed stage models
    layouts = [(True, True), (False, False), (True, False), (False, True)]
    local = cfg.num_key_value_heads, cfg.head_dim
    caches = {lay: [[torch.full((2, NUM_BLOCKS, BLOCK, *local), float("nan"), dtype=dtype) for _ in range(2)]
                    for _ in range(2)] for lay in layouts}
    rng = random.Random(1)
    with torch.inference_mode():
        for i, (seqs, num_decodes) in enumerate(STEPS):
            positions, meta = _step(seqs, num_decodes)
            ids = torch.tensor([rng.randrange(cfg.vocab_size) for _ in range(positions.shape[0])])
            results = {lay: _run(cfg, stages, lay, ids, positions, meta, caches[lay]) for lay in layouts}
            (pair, hidden) = results[(False, False)]
            assert not hidden.isnan().any()
            for lay, (p, h) in results.items():
                assert torch.equal(p[0], pair[0]) and torch.equal(p[1], pair[1]), f"step {i} {lay}: the pair differs"
                assert torch.equal(h, hidden), f"step {i} {lay}: the final hidden state differs"
                for a, b in zip(caches[lay], caches[(False, False)]):
                    for x, y in zip(a, b):
                        assert torch.equal(x.nan_to_num(), y.nan_to_num()), f"step {i} {lay}: KV differs"
    assert stages[0][1].steps_run == 2 * len(STEPS) and stages[1][1].steps_run == 2 * len(STEPS)
    assert stages[0][1].steps_declined == 0 == stages[1][1].steps_declined
