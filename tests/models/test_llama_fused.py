"""The fused decoder stack (one C++ call a step) against the module path it replaces.

Both run the same kernels in the same order, so hidden states and KV caches must be equal
bit for bit, step after step: prefill chunks, chunks over cached context, decodes, mixed.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers.attention import AttentionMetadata, CPUAttentionBackend
from kvflow.loader import load_model, load_model_config

BLOCK = 16


@pytest.fixture(autouse=True)
def _needs_bf16(bf16_kernels):
    """The fused stack exists only where the bf16 kernels do (skips on CPUs without AVX512-BF16)."""


def _model(path: str):
    cfg = load_model_config(path)
    return cfg, load_model(path, cfg, torch.bfloat16, CPUAttentionBackend())


def _step(seqs: list[tuple[list[int], int, int]], num_decodes: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """seqs: (block table, tokens already cached, new tokens) each; decodes first."""
    positions, slots, starts, lens = [], [], [0], []
    for table, cached, new in seqs:
        pos = list(range(cached, cached + new))
        positions += pos
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in pos]
        starts.append(starts[-1] + new)
        lens.append(cached + new)
    width = max(len(t) for t, _, _ in seqs)
    tables = torch.tensor([t + [0] * (width - len(t)) for t, _, _ in seqs], dtype=torch.int64)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=starts,
                             seq_lens=lens, block_tables=tables, num_decodes=num_decodes, block_size=BLOCK)
    return torch.tensor(positions, dtype=torch.int64), meta


# Three sequences over shuffled blocks: A prefilled whole, B in two chunks, C joining late.
STEPS = [
    ([([7, 2], 0, 21), ([4, 9, 1], 0, 32)], 0),  # first chunks
    ([([7, 2], 21, 1), ([4, 9, 1], 32, 8), ([5, 3], 0, 13)], 1),  # a decode, a chunk over cached context, a new prompt
    ([([7, 2], 22, 1), ([4, 9, 1], 40, 1), ([5, 3], 13, 1)], 3),  # decodes only
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the QKV bias
def test_fused_stack_equals_modules_bitwise(arch, tiny_models):
    path, _ = tiny_models(arch)
    cfg, model = _model(path)
    assert model.fused_stack is not None, "the fused stack should apply to this model"
    fused_stack = model.fused_stack
    caches = {}
    for name in ("fused", "modules"):
        caches[name] = [torch.full((2, 12, BLOCK, cfg.num_key_value_heads, cfg.head_dim), float("nan"),
                                   dtype=torch.bfloat16) for _ in range(cfg.num_hidden_layers)]
    rng = random.Random(0)
    with torch.inference_mode():
        for seqs, num_decodes in STEPS:
            positions, meta = _step(seqs, num_decodes)
            ids = torch.tensor([rng.randrange(cfg.vocab_size) for _ in range(positions.shape[0])])
            model.fused_stack = fused_stack
            fused = model(ids, positions, caches["fused"], meta)
            model.fused_stack = None
            modules = model(ids, positions, caches["modules"], meta)
            assert not fused.isnan().any()
            assert torch.equal(fused, modules), f"step with {len(seqs)} sequences differs"
            for a, b in zip(caches["fused"], caches["modules"]):
                assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_fused_stack_needs_every_kernel(tiny_models, monkeypatch):
    """qk-norm (Qwen3) and float32 keep the module path; KVFLOW_FUSED_STACK=0 turns it off."""
    assert _model(tiny_models("qwen3")[0])[1].fused_stack is None
    path = tiny_models("llama")[0]
    cfg = load_model_config(path)
    assert load_model(path, cfg, torch.float32, CPUAttentionBackend()).fused_stack is None
    monkeypatch.setenv("KVFLOW_FUSED_STACK", "0")
    assert _model(path)[1].fused_stack is None


def test_fused_stack_rejects_positions_past_the_rotary_table(tiny_models):
    path, _ = tiny_models("llama")
    cfg, model = _model(path)
    caches = [torch.zeros((2, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim), dtype=torch.bfloat16)]
    positions, meta = _step([([0], 0, 3)], 0)
    positions[1] = cfg.max_position_embeddings
    with torch.inference_mode(), pytest.raises(IndexError, match="outside the table"):
        model(torch.tensor([1, 2, 3]), positions, caches * cfg.num_hidden_layers, meta)


def test_engine_output_is_the_same_fused_or_not(tiny_models, monkeypatch):
    """End to end through the scheduler (chunked prefill, batching): the same tokens either way."""
    path, _ = tiny_models("llama")
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]} for n in (5, 40, 77, 18)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVFLOW_FUSED_STACK", flag)
        llm = LLM(path, dtype="bfloat16", kv_cache_memory=1 << 22, max_num_batched_tokens=48)
        assert (llm.engine.runner.model.fused_stack is not None) == (flag == "1")
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[flag] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results["1"] == results["0"]
