"""LoRA inside the fused C++ stack: the same bits as the modules' `LoRALinear`, and the stack
really runs the adapter steps (models/llama_fused.py, csrc/llama_forward.cpp)."""

from __future__ import annotations

import pytest

from kvflow import LLM, LoRARequest, SamplingParams
from tests.lora.test_lora import lora, prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


def run(lora_models, monkeypatch, dtype: str, fused: bool):
    monkeypatch.setenv("KVFLOW_FUSED_STACK", "1" if fused else "0")
    llm = LLM(lora_models["path"], dtype=dtype, enable_lora=True, max_loras=3, kv_cache_memory=32 << 20,
              max_num_batched_tokens=40)
    names = ["all", None, "qv", "all", "mlp", "qv"]
    ids = {"all": 1, "qv": 2, "mlp": 3}
    batch = prompts(43, len(names))
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS, use_tqdm=False,
                        lora_request=[None if n is None else lora(lora_models, n, ids[n]) for n in names])
    stack = llm.engine.runner.model.fused_stack
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], stack


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_stack_runs_adapters_with_the_modules_bits(lora_models, monkeypatch, dtype):
    modules, none = run(lora_models, monkeypatch, dtype, fused=False)
    assert none is None
    fused, stack = run(lora_models, monkeypatch, dtype, fused=True)
    if stack is None:
        pytest.skip("this CPU has no fused stack for the tiny model")
    assert stack.steps_run > 0 and stack.steps_declined == 0
    assert fused == modules  # tokens and every logprob, bit for bit (chunked prefills, mixed adapters)


def test_an_adapter_the_stack_cannot_run_falls_back_to_the_modules(lora_models, monkeypatch):
    """An adapter whose A/B did not take kvflow's layout (here: forced) runs on the modules."""
    monkeypatch.setenv("KVFLOW_FUSED_STACK", "1")
    llm = LLM(lora_models["path"], dtype="float32", enable_lora=True, kv_cache_memory=32 << 20)
    stack = llm.engine.runner.model.fused_stack
    if stack is None:
        pytest.skip("this CPU has no fused stack for the tiny model")
    manager = llm.engine.lora
    monkeypatch.setattr(manager, "_fused_projections", lambda lora_int_id: None)
    before = stack.steps_run
    out = llm.generate([{"prompt_token_ids": prompts(47, 1)[0]}], PARAMS, use_tqdm=False,
                       lora_request=LoRARequest("all", 1, str(lora_models["root"] / "all")))[0]
    assert stack.steps_run == before  # every step had the adapter's rows
    assert out.outputs[0].token_ids
