"""The fused decoder stack (one C++ call a step) against the module path it replaces.

Both run the same kernels in the same order, so hidden states and KV caches must be equal
bit for bit, step after step: prefill chunks, chunks over cached context, decodes, mixed; in
bf16 and in float32.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers.attention import AttentionMetadata, CPUAttentionBackend
from kvflow.loader import load_model, load_model_config
from tests.conftest import save_random_model

BLOCK = 16
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


@pytest.fixture
def dtype() -> torch.dtype:
    """bf16 for the tests not parametrised over the dtype (DTYPES overrides this fixture)."""
    return torch.bfloat16


@pytest.fixture(autouse=True)
def _needs_the_kernels(kernels, dtype):
    """The fused stack exists only where the GEMM of its dtype does (bf16: AVX512-BF16)."""
    if not kernels.has_gemm(dtype):
        pytest.skip(f"this CPU lacks the instructions of kvflow's {dtype} GEMM")


def _model(path: str, dtype: torch.dtype = torch.bfloat16):
    cfg = load_model_config(path)
    return cfg, load_model(path, cfg, dtype, CPUAttentionBackend())


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


def _many_sequence_steps(num_seqs: int = 12, num_blocks: int = 60) -> list:
    """Enough sequences that decode attention takes whole-sequence work items."""
    rng = random.Random(5)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables = [blocks[4 * i: 4 * i + 4] for i in range(num_seqs)]
    lens = [rng.randrange(3, 40) for _ in range(num_seqs)]
    first = [(tables[i], 0, lens[i]) for i in range(num_seqs)]
    mixed = [(tables[i], lens[i], 1) for i in range(num_seqs - 3)] + \
            [(tables[i], lens[i], 7) for i in range(num_seqs - 3, num_seqs)]  # decodes, then chunks
    grown = [n + (1 if i < num_seqs - 3 else 7) for i, n in enumerate(lens)]
    decodes = [(tables[i], grown[i], 1) for i in range(num_seqs)]
    return [(first, 0), (mixed, num_seqs - 3), (decodes, num_seqs)]


@pytest.fixture(scope="module")
def head_dim_64_llama(tmp_path_factory) -> str:
    """A tiny Llama whose heads are 64 wide, as SmolLM2's: q.k takes the AVX512-BF16 dot product."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    return save_random_model(cfg, tmp_path_factory.mktemp("tiny-llama-d64"), seed=4321)[0]


def _assert_fused_equals_modules(path: str, steps: list, num_blocks: int, dtype: torch.dtype,
                                 kv_cache_dtype: str = "auto") -> None:
    cfg, model = _model(path, dtype)
    fused_stack = model.fused_stack
    assert fused_stack is not None, "the fused stack should apply to this model"
    caches = {}
    for name in ("fused", "modules"):
        if kv_cache_dtype == "int8":
            caches[name] = CPUAttentionBackend().allocate_kv_caches(
                cfg.num_hidden_layers, num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype, "int8")
            continue
        caches[name] = [torch.full((2, num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim), float("nan"),
                                   dtype=dtype) for _ in range(cfg.num_hidden_layers)]
    rng = random.Random(0)
    with torch.inference_mode():
        for i, (seqs, num_decodes) in enumerate(steps):
            positions, meta = _step(seqs, num_decodes)
            ids = torch.tensor([rng.randrange(cfg.vocab_size) for _ in range(positions.shape[0])])
            model.fused_stack = fused_stack
            fused = model(ids, positions, caches["fused"], meta)
            assert fused_stack.steps_run == i + 1, "the step fell back to the modules"
            model.fused_stack = None
            modules = model(ids, positions, caches["modules"], meta)
            assert not fused.isnan().any()
            assert torch.equal(fused, modules), f"step {i} ({len(seqs)} sequences) differs"
            for a, b in zip(caches["fused"], caches["modules"]):
                if kv_cache_dtype == "int8":
                    assert torch.equal(a.data, b.data) and torch.equal(a.scales.view(torch.int16), b.scales.view(torch.int16))
                else:
                    assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert fused_stack.steps_declined == 0


@DTYPES
# qwen2: the QKV bias; qwen3: per-head q/k norms; mixtral, qwen2moe, qwen3moe: mixtures of experts
# (csrc/moe.cpp), qwen2moe with a shared expert and a dense layer
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mixtral", "qwen2moe", "qwen3moe"])
def test_fused_stack_equals_modules_bitwise(arch, dtype, tiny_models):
    _assert_fused_equals_modules(tiny_models(arch)[0], STEPS, num_blocks=12, dtype=dtype)


@DTYPES
def test_fused_stack_equals_modules_bitwise_head_dim_64_many_sequences(head_dim_64_llama, dtype):
    _assert_fused_equals_modules(head_dim_64_llama, _many_sequence_steps(), num_blocks=60, dtype=dtype)


@DTYPES
def test_fused_stack_with_an_int8_kv_cache_equals_modules_bitwise(head_dim_64_llama, dtype, tiny_models):
    """kv_cache_dtype="int8": the stack quantizes K/V into the int8 pool and runs the int8
    attention kernel, as the modules do, instead of declining the step."""
    _assert_fused_equals_modules(head_dim_64_llama, _many_sequence_steps(), num_blocks=60, dtype=dtype,
                                 kv_cache_dtype="int8")
    _assert_fused_equals_modules(tiny_models("llama")[0], STEPS, num_blocks=12, dtype=dtype, kv_cache_dtype="int8")


@DTYPES
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_fused_qk_norms_over_many_sequences_equal_modules_bitwise(arch, kv_cache_dtype, dtype, tiny_models):
    """Per-head q/k norms on a first step of well over 64 tokens (the norm loop's threaded
    branch), then decodes and chunks, with either KV cache."""
    assert sum(new for _, _, new in _many_sequence_steps()[0][0]) >= 64
    _assert_fused_equals_modules(tiny_models(arch)[0], _many_sequence_steps(), num_blocks=60, dtype=dtype,
                                 kv_cache_dtype=kv_cache_dtype)


def test_fused_stack_declines_a_step_it_cannot_take(tiny_models):
    """Metadata that disagrees with the batch runs on the modules (counted), never in C++."""
    path, _ = tiny_models("llama")
    cfg, model = _model(path)
    caches = [torch.zeros((2, 12, BLOCK, cfg.num_key_value_heads, cfg.head_dim), dtype=torch.bfloat16)
              for _ in range(cfg.num_hidden_layers)]
    positions, meta = _step(*STEPS[0])
    meta.slot_mapping = meta.slot_mapping[:-1]  # one slot short
    with torch.inference_mode():
        assert model.fused_stack(model.embed_tokens(torch.zeros(53, dtype=torch.int64)), positions, caches, meta) is None
    assert model.fused_stack.steps_declined == 1 and model.fused_stack.steps_run == 0


def test_fused_stack_needs_every_kernel(tiny_models, monkeypatch):
    """float16 (no kernels) and an attention backend without kernels keep the module path;
    KVFLOW_FUSED_STACK=0 turns it off."""
    path = tiny_models("llama")[0]
    cfg = load_model_config(path)
    assert load_model(path, cfg, torch.float16, CPUAttentionBackend()).fused_stack is None
    assert load_model(path, cfg, torch.bfloat16, CPUAttentionBackend(use_kernels=False)).fused_stack is None
    monkeypatch.setenv("KVFLOW_FUSED_STACK", "0")
    assert _model(path)[1].fused_stack is None


def test_fused_stack_rejects_positions_past_the_rotary_table(tiny_models):
    path, _ = tiny_models("llama")
    cfg, model = _model(path)
    caches = [torch.zeros((2, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim), dtype=torch.bfloat16)]
    positions, meta = _step([([0], 0, 3)], 0)
    positions[1] = cfg.max_position_embeddings
    x = model.embed_tokens(torch.tensor([1, 2, 3]))
    with torch.inference_mode(), pytest.raises(IndexError, match="fused Llama stack: .*outside the rotary table"):
        model.fused_stack(x, positions, caches * cfg.num_hidden_layers, meta)


@DTYPES
def test_engine_output_is_the_same_fused_or_not(tiny_models, monkeypatch, dtype):
    """End to end through the scheduler (chunked prefill, batching): the same tokens either way."""
    path, _ = tiny_models("llama")
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]} for n in (5, 40, 77, 18)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVFLOW_FUSED_STACK", flag)
        llm = LLM(path, dtype=str(dtype).removeprefix("torch."), kv_cache_memory=1 << 22, max_num_batched_tokens=48)
        stack = llm.engine.runner.model.fused_stack
        assert (stack is not None) == (flag == "1")
        outs = llm.generate(prompts, params, use_tqdm=False)
        if stack is not None:
            assert stack.steps_run > 0 and stack.steps_declined == 0
        results[flag] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results["1"] == results["0"]


def test_loading_weights_after_packing_is_refused(tiny_models):
    """Packed Linears hold no plain weight to load into: a late load must fail, not be dropped."""
    from kvflow.loader import iter_weights

    path, _ = tiny_models("llama")
    _, model = _model(path)
    with pytest.raises(RuntimeError, match="packed and the plain copy released"):
        model.load_weights(iter_weights(path))
