"""Mixtures of experts (layers/moe.py) on tiny random Mixtral, Qwen2-MoE and Qwen3-MoE models:
the routed block against transformers' own, a request's bits however the scheduler cuts the
work, weight quantization (routers stay float), the shape counts, and the refusals.

(Greedy tokens against transformers for each architecture: test_architectures.py.)
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.distributed.config import ParallelConfig
from kvflow.distributed.plan import rank_num_parameters
from kvflow.layers.linear import Linear, pack_linear_weights
from kvflow.layers.moe import SparseMoeBlock, vector_sigmoid
from kvflow.models.llama import build_mlp
from tests.conftest import assert_greedy_match, hf_greedy

MOE_ARCHS = ["mixtral", "qwen2moe", "qwen3moe"]
PARAMS = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=2)


def _ours_from_hf(hf_block, cfg: ModelConfig, dtype: torch.dtype) -> SparseMoeBlock:
    """kvflow's block holding the weights of transformers' (whose experts are 3-D tensors)."""
    block = build_mlp(cfg, 0).to(dtype)
    with torch.no_grad():
        block.gate.weight.copy_(hf_block.gate.weight)
        for e, expert in enumerate(block.experts):
            expert.gate_up_proj.weight.copy_(hf_block.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(hf_block.experts.down_proj[e])
        if block.shared_expert is not None:
            shared = hf_block.shared_expert
            block.shared_expert.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
            block.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
            block.shared_expert_gate.weight.copy_(hf_block.shared_expert_gate.weight)
    pack_linear_weights(block)
    return block


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_block_matches_transformers_and_is_batch_invariant(arch, path, tiny_models):
    """Both paths of the block: csrc/moe.cpp (packed weights) and its PyTorch ops (elsewhere)."""
    _, hf = tiny_models(arch)
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    hf_block = hf.model.layers[0].mlp
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(3))

    def run(block: SparseMoeBlock, rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return block(rows) if path == "kernel" else block.forward_torch(rows)

    ours = _ours_from_hf(hf_block, cfg, torch.float32)
    assert path == "torch" or ours.kernel_record() is not None, "the block's weights were not bound for its kernel"
    with torch.no_grad():
        ref = hf_block(x.unsqueeze(0))[0]
        _, ref_experts = hf_block.gate(x)[1:]
    assert torch.equal(ours.route(x)[1], ref_experts), "the router picked other experts than transformers'"
    torch.testing.assert_close(run(ours, x), ref, rtol=1e-5, atol=1e-6)
    for dtype in (torch.float32, torch.bfloat16):
        block = _ours_from_hf(hf_block, cfg, dtype)
        rows = x.to(dtype)
        batched = run(block, rows)
        alone = torch.cat([run(block, rows[i: i + 1]) for i in range(len(rows))])
        assert torch.equal(batched, alone), f"{dtype}: a token's output changed with the batch around it"
        torch.testing.assert_close(batched.float(), ref, rtol=0.05, atol=0.02)


def test_parameter_count_matches_transformers(tiny_models):
    """`kvflow plan` sizes weights from the config alone: every expert, router and shared expert."""
    for arch in MOE_ARCHS + ["llama", "qwen3"]:
        _, hf = tiny_models(arch)
        cfg = ModelConfig.from_hf_config(hf.config.to_dict())
        assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters()), arch
    mixtral = ModelConfig.from_hf_config(tiny_models("mixtral")[1].config.to_dict())
    stages = ParallelConfig(tensor_parallel_size=1, pipeline_parallel_size=2)  # (a rank's plan: its layers' experts)
    assert sum(rank_num_parameters(mixtral, stages, r) for r in range(2)) == mixtral.num_parameters()
    cfg = ModelConfig.from_hf_config(tiny_models("qwen2moe")[1].config.to_dict())
    assert cfg.moe_layers == [0]  # mlp_only_layers=[1]
    dense = 3 * cfg.hidden_size * cfg.intermediate_size
    routed = 3 * cfg.hidden_size * (2 * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)
    attention = cfg.num_linear_parameters() - cfg.mlp_linear_parameters(0) - cfg.mlp_linear_parameters(1)
    assert cfg.num_linear_parameters(active=True) == attention + dense + routed


# ---- a request's bits do not depend on how the scheduler cut the work ----------------------

def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 300, 40).tolist()
    prompts = [rng.integers(3, 300, n).tolist() for n in list(range(1, 25)) + [70, 90, 130, 170]]
    for i in range(0, len(prompts), 3):
        prompts[i] = shared + prompts[i]
    return prompts


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS, keep: int = PARAMS.max_tokens
         ) -> list[tuple]:
    """Each request's first `keep` tokens and their steps' logprobs, with the pool checked after."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_integrity()
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks, "blocks were not all returned to the pool"
    n = keep
    return [(tuple(o.outputs[0].token_ids[:n]), tuple(tuple(sorted(lp.items())) for lp in o.outputs[0].logprobs[:n]))
            for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_scheduling_does_not_change_bits(arch, dtype, tiny_models):
    path, _ = tiny_models(arch)
    prompts = _prompts()
    ref = _run(LLM(path, dtype=dtype, enable_prefix_caching=False), prompts)
    cached = LLM(path, dtype=dtype)
    runs = {"prefix cache, cold": _run(cached, prompts), "prefix cache, warm": _run(cached, prompts)}
    assert cached.engine.get_stats().prefix_cache_hits > 0
    for config in (dict(max_num_batched_tokens=7), dict(max_num_seqs=1)):
        runs[str(config)] = _run(LLM(path, dtype=dtype, enable_prefix_caching=False, **config), prompts)
    cfg = ModelConfig.from_hf_config(json.loads((__import__("pathlib").Path(path) / "config.json").read_text()))
    small = LLM(path, dtype=dtype, enable_prefix_caching=False, max_model_len=256, max_num_batched_tokens=64,
                kv_cache_memory=2 * 256 * cfg.kv_bytes_per_token(getattr(torch, dtype)))
    small.engine.scheduler.config.admission_headroom_blocks = 0
    runs["preempted"] = _run(small, prompts, SamplingParams(temperature=0, max_tokens=40, min_tokens=40, logprobs=2))
    assert small.engine.get_stats().num_preemptions > 0, "the pool was large enough that nothing was preempted"
    for label, got in runs.items():
        bad = [i for i, (g, r) in enumerate(zip(got, ref)) if g != r]
        assert not bad, f"{arch} {dtype} {label}: prompts {bad} differ from the reference"


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_parallel_layouts_match_transformers(arch, layout, tiny_models, monkeypatch):
    """T=2: every expert (and the shared one) split across the ranks, one all-reduce per block.
    P=2 over Qwen2-MoE's sparse layer 0 and dense layer 1: each stage numbers its layers from 0,
    and the second one's must still be dense (ParallelConfig.rank_model_config)."""
    monkeypatch.setenv("KVFLOW_WORKER_MULTIPROC_METHOD", "fork")  # see tests/distributed
    monkeypatch.setenv("KVFLOW_OVERSUBSCRIBE", "1")
    path, hf = tiny_models(arch)
    prompts = _prompts()[20:26]
    llm = LLM(path, dtype="float32", num_threads=1, max_num_batched_tokens=48, **layout)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_greedy_match(out.outputs[0].token_ids, *hf_greedy(hf, prompt, 8)[:2], label=f"len={len(prompt)}")
    llm.shutdown()


def test_ngram_speculation_keeps_greedy_tokens(tiny_models):
    """A verify step runs several tokens of a sequence through the experts at once."""
    path, _ = tiny_models("qwen3moe")
    rng = np.random.default_rng(13)
    repetitive = [(rng.integers(3, 320, int(rng.integers(3, 8))).tolist() * 10)[:60] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
             "disable_by_batch_size": None}
    plain = _run(LLM(path, dtype="float32"), repetitive, params, keep=24)
    spec = LLM(path, dtype="float32", speculative_config=ngram)
    assert _run(spec, repetitive, params, keep=24) == plain
    assert spec.engine.speculator.stats.num_draft_tokens > 0, "nothing was speculated"


# ---- weight quantization ---------------------------------------------------------------------

def test_int8_quantizes_experts_but_not_routers(tiny_models):
    path, _ = tiny_models("qwen2moe")
    prompts = _prompts()[:12]
    plain = _run(LLM(path, dtype="float32"), prompts)
    llm = LLM(path, dtype="float32", quantization="int8")
    model = llm.engine.runner.model
    block = model.layers[0].mlp
    assert all(e.gate_up_proj.quant_weight is not None and e.down_proj.quant_weight is not None
               for e in block.experts)
    assert block.shared_expert.down_proj.quant_weight is not None
    assert block.gate.quant_weight is None and block.shared_expert_gate.quant_weight is None
    quantized = _run(llm, prompts)
    agree = np.mean([a == b for q, p in zip(quantized, plain) for a, b in zip(q[0], p[0])])
    assert agree >= 0.8, f"int8 greedy tokens agree with float32 on only {agree:.0%}"
    alone = [_run(llm, [p])[0] for p in prompts[:4]]
    assert alone == quantized[:4], "int8: a token's bits changed with the batch around it"


def test_int4_experts_run_in_the_kernel_and_fused_stack(tiny_models, monkeypatch):
    """bf16 with int4 experts: their tiles go to csrc/moe.cpp (and the fused stack); a token's
    bits do not depend on the batch, and its tokens are the PyTorch block's on the same weights
    (the two differ only in the softmax's exp)."""
    path, _ = tiny_models("mixtral")
    prompts = _prompts()[:12]
    llm = LLM(path, dtype="bfloat16", quantization="int4")
    model = llm.engine.runner.model
    block = model.layers[0].mlp
    assert {e.down_proj.packing for e in block.experts} == {"quantized-tiles"}
    assert block.kernel_record() is not None and model.fused_stack is not None
    quantized = _run(llm, prompts)
    assert model.fused_stack.steps_run > 0 and model.fused_stack.steps_declined == 0
    alone = [_run(llm, [p])[0] for p in prompts[:4]]
    assert alone == quantized[:4], "int4: a token's bits changed with the batch around it"
    monkeypatch.setenv("KVFLOW_MOE_KERNEL", "0")
    torch_path = LLM(path, dtype="bfloat16", quantization="int4")
    assert torch_path.engine.runner.model.fused_stack is None
    reference = _run(torch_path, prompts)
    agree = np.mean([a == b for q, p in zip(quantized, reference) for a, b in zip(q[0], p[0])])
    assert agree >= 0.9, f"the kernel's tokens agree with the PyTorch block's on only {agree:.0%}"


def test_mixtral_expert_names_count_as_linear_weights():
    """int8/int4 quantize Mixtral's experts as they load (peak memory: one float tensor), and
    GPTQ/compressed-tensors/GGUF experts run as shipped, though their names end in w1/w2/w3."""
    from kvflow.loader import _quantized_as_loaded, _runs_as_shipped
    from kvflow.quantization.config import QuantizationConfig
    from kvflow.quantization.qweight import QuantizedWeight

    expert, router = "model.layers.0.block_sparse_moe.experts.3.w2.weight", "model.layers.0.block_sparse_moe.gate.weight"
    assert _runs_as_shipped(expert) and not _runs_as_shipped(router)
    loaded = dict(_quantized_as_loaded(iter([(expert, torch.randn(64, 64)), (router, torch.randn(8, 64))]),
                                       QuantizationConfig.parse("int8")))
    assert isinstance(loaded[expert], QuantizedWeight) and isinstance(loaded[router], torch.Tensor)


# ---- refusals ----------------------------------------------------------------------------

def test_refusals_name_the_setting(tiny_models, tmp_path):
    path, _ = tiny_models("mixtral")
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters on a mixture-of-experts model"):
        LLM(path, enable_lora=True, dtype="float32")
    broken = tmp_path / "missing-expert"
    shutil.copytree(path, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights for: layers\.1\.mlp\.experts\.5\.gate_up_proj\.weight"):
        LLM(str(broken), dtype="float32")
    config = json.loads((tmp_path / "missing-expert" / "config.json").read_text())
    bad = tmp_path / "top-k"
    shutil.copytree(path, bad)
    (bad / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 9}))
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and the model's 8 experts"):
        LLM(str(bad), dtype="float32")


def test_dummy_weights_from_a_moe_config(tmp_path, tiny_models):
    path, _ = tiny_models("qwen3moe")
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", kv_cache_memory=1 << 20)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert sum(m.out_features * m.in_features for m in linears) == (
        ModelConfig.from_hf_config(json.loads((tmp_path / "config.json").read_text())).num_linear_parameters()
        + 2 * 8 * 64 + 320 * 64)  # + the two layers' routers and the LM head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_sigmoid_gives_an_element_the_same_bits_wherever_it_sits(dtype):
    """The shared expert's gate: PyTorch's sigmoid differs between its vector loop and the
    scalar tail, so plain torch.sigmoid fails this."""
    x = (torch.randn(40000, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    whole = vector_sigmoid(x)
    torch.testing.assert_close(whole, torch.sigmoid(x), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=0)
    for start, length in [(0, 1), (5, 3), (17, 100), (31000, 9000), (16380, 9)]:
        assert torch.equal(vector_sigmoid(x[start: start + length]), whole[start: start + length]), (start, length)
    assert torch.equal(vector_sigmoid(x[:6].view(2, 3)), whole[:6].view(2, 3))
