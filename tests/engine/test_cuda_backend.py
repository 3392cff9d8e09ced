"""The engine on the CUDA attention backend: greedy float32 output equals the CPU backend's, with
batching, chunked prefill and the prefix cache in play, and every KV block comes back.

Without a GPU the backend's Triton kernels run under the interpreter on CPU tensors (the model
and the pool stay on the CPU), which checks everything the backend adds on the path from the
runner down: its layout, the KV store, the decode/prefill split and its metadata. On a GPU
(scripts/gpu_check) the same test runs with the engine on device="cuda".
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.conftest import assert_greedy_match, save_tiny_llama, shared_prefix_prompts
from tests.engine.cuda_reference import greedy_reference
from tests.layers.triton.interpreter import DEVICE, load_kernels

load_kernels()
from kvflow.layers.cuda_attention import CUDAAttentionBackend  # noqa: E402

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-cuda"))[0]


@pytest.fixture(scope="module")
def cpu_outputs(tiny):
    prompts = shared_prefix_prompts(seed=3, num_own=2)
    return prompts, greedy_reference(tiny, prompts, PARAMS.max_tokens, max_num_batched_tokens=64)


def _llm_on_cuda_backend(tiny, monkeypatch, **kwargs) -> LLM:
    if DEVICE == "cuda":
        return LLM(tiny, dtype="float32", device="cuda", kv_cache_memory=64 << 20, **kwargs)
    monkeypatch.setattr("kvflow.engine.model_placement.get_attn_backend", lambda device: CUDAAttentionBackend("cpu"))
    return LLM(tiny, dtype="float32", device="cpu", **kwargs)


def test_greedy_equals_cpu_backend(tiny, cpu_outputs, monkeypatch):
    """A budget of 24 tokens cuts the longer prompts into chunks over cached context and runs
    decodes beside them; the shared-prefix prompts hit the prefix cache."""
    prompts, want = cpu_outputs
    llm = _llm_on_cuda_backend(tiny, monkeypatch, max_num_batched_tokens=24)
    assert isinstance(llm.engine.runner.model.layers[0].self_attn.attn.backend, CUDAAttentionBackend)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, want)):
        assert_greedy_match(out.outputs[0].token_ids, *ref, f"prompt {i}")
    kv = llm.engine.kv_cache_manager
    llm.engine.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
