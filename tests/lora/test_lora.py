"""LoRA adapters against PEFT's own models, greedy in float32: alone, batched with other adapters
and the base model, chunked, preempted, cached, speculated, and refused when they cannot run."""

from __future__ import annotations

import random

import pytest

from kvflow import LLM, LoRARequest, SamplingParams
from tests.conftest import assert_greedy_match, hf_greedy
from tests.lora.conftest import edit_adapter_config

NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def prompts(seed: int, count: int, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def lora(lora_models, name: str, lora_int_id: int) -> LoRARequest:
    return LoRARequest(name, lora_int_id, str(lora_models["root"] / name))


def reference(lora_models, name: str | None, prompt: list[int]):
    """PEFT's greedy tokens and top-2 gaps for `prompt` with adapter `name` (None: the base model)."""
    model = lora_models["hf"] if name is None else lora_models["peft"][name]
    return hf_greedy(model, prompt, NEW)[:2]


def engine(lora_models, **kwargs) -> LLM:
    return LLM(lora_models["path"], dtype="float32", enable_lora=True, kv_cache_memory=32 << 20, **kwargs)


def generate(llm: LLM, batch: list[list[int]], loras, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False, lora_request=loras)
    llm.engine.check_integrity()
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    return outs


def test_each_adapter_matches_peft(lora_models):
    llm = engine(lora_models)
    for i, name in enumerate(["all", "qv", "mlp"]):
        for j, prompt in enumerate(prompts(i, 2)):
            out = generate(llm, [prompt], lora(lora_models, name, i + 1))[0]
            assert out.lora_request.lora_name == name
            assert_greedy_match(out.outputs[0].token_ids, *reference(lora_models, name, prompt), f"{name} prompt {j}")


def test_adapters_change_the_output(lora_models):
    """Else every other test here would pass with the adapters ignored."""
    prompt = prompts(7, 1)[0]
    base = reference(lora_models, None, prompt)[0]
    for name in ("all", "qv", "mlp"):
        assert reference(lora_models, name, prompt)[0] != base, name


def test_mixed_batch_matches_peft(lora_models):
    """Adapters and the base model interleaved in one batch (decodes of several adapters in one step,
    index-tensor row groups), with chunked prefill cutting the prompts across steps."""
    llm = engine(lora_models, max_loras=3, max_num_batched_tokens=48)
    names = ["all", None, "qv", "all", "mlp", None, "qv", "all"]
    batch = prompts(11, len(names))
    ids = {"all": 1, "qv": 2, "mlp": 3}
    outs = generate(llm, batch, [None if n is None else lora(lora_models, n, ids[n]) for n in names])
    for i, (name, prompt, out) in enumerate(zip(names, batch, outs)):
        assert_greedy_match(out.outputs[0].token_ids, *reference(lora_models, name, prompt), f"{name} prompt {i}")


def test_max_loras_bounds_each_step(lora_models):
    """With max_loras=1 the scheduler runs one adapter at a time (the base model beside it), and
    every request still finishes with its adapter's output."""
    llm = engine(lora_models, max_loras=1)
    seen: list[set[int]] = []
    manager = llm.engine.lora
    set_step = manager.set_step

    def spy(row_adapters, row_tokens):
        seen.append(set(row_adapters) - {0})
        return set_step(row_adapters, row_tokens)

    manager.set_step = spy
    names = ["all", "qv", None, "mlp", "qv"]
    ids = {"all": 1, "qv": 2, "mlp": 3}
    batch = prompts(13, len(names))
    outs = generate(llm, batch, [None if n is None else lora(lora_models, n, ids[n]) for n in names])
    assert max(len(s) for s in seen) == 1
    assert len(set().union(*seen)) == 3
    for name, prompt, out in zip(names, batch, outs):
        assert_greedy_match(out.outputs[0].token_ids, *reference(lora_models, name, prompt), str(name))


def test_prefix_cache_keeps_adapters_apart(lora_models):
    """The base model's cached K/V must never serve an adapter's request (nor one adapter's
    another's), while an adapter's own repeat is served from the cache."""
    llm = engine(lora_models, max_loras=2, block_size=4)
    prompt = prompts(17, 1, 40, 40)[0]
    base = generate(llm, [prompt], None)[0]
    first = generate(llm, [prompt], lora(lora_models, "all", 1))[0]
    other = generate(llm, [prompt], lora(lora_models, "qv", 2))[0]
    again = generate(llm, [prompt], lora(lora_models, "all", 1))[0]
    assert base.num_cached_tokens == first.num_cached_tokens == other.num_cached_tokens == 0
    assert again.num_cached_tokens > 0
    ref = reference(lora_models, "all", prompt)
    assert_greedy_match(first.outputs[0].token_ids, *ref, "first")
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_greedy_match(other.outputs[0].token_ids, *reference(lora_models, "qv", prompt), "other adapter")


def test_preemption_recomputes_with_the_adapter(lora_models):
    """A pool too small for the batch: sequences are preempted and recomputed, adapters intact."""
    llm = LLM(lora_models["path"], dtype="float32", enable_lora=True, max_loras=2, block_size=4,
              kv_cache_memory=24 * 2048, max_model_len=80)  # 24 blocks of 2 KiB
    names = ["all", "mlp", "all", "mlp"]
    batch = prompts(19, len(names), 30, 50)
    outs = generate(llm, batch, [lora(lora_models, n, 1 if n == "all" else 3) for n in names],
                    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    for name, prompt, out in zip(names, batch, outs):
        tokens, gaps, _ = hf_greedy(lora_models["peft"][name], prompt, 24)
        assert_greedy_match(out.outputs[0].token_ids, tokens, gaps, name)


def test_ngram_speculation_stays_exact(lora_models):
    llm = engine(lora_models, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    rng = random.Random(23)
    motif = [rng.randrange(3, 320) for _ in range(6)]
    prompt = motif * 5  # repeats, so the n-gram proposer drafts
    out = generate(llm, [prompt], lora(lora_models, "all", 1))[0]
    assert_greedy_match(out.outputs[0].token_ids, *reference(lora_models, "all", prompt), "speculated")


def test_unused_adapters_are_evicted_beyond_the_cache(lora_models):
    llm = engine(lora_models, max_loras=1, max_cpu_loras=2)
    prompt = prompts(29, 1)[0]
    for i, name in enumerate(["all", "qv", "mlp", "all"]):
        out = generate(llm, [prompt], lora(lora_models, name, i + 1))[0]
        assert_greedy_match(out.outputs[0].token_ids, *reference(lora_models, name, prompt), name)
        assert len(llm.engine.lora.adapters) <= 2
    assert list(llm.engine.lora.adapters) == [3, 4]
    assert all(set(layer.adapters) <= {3, 4} for layer in llm.engine.lora.layers.values())


def test_base_steps_keep_the_fused_stack(lora_models):
    llm = engine(lora_models)
    model = llm.engine.runner.model
    if model.fused_stack is None:
        pytest.skip("this CPU runs the tiny model on its modules (no fused stack to keep)")
    before = model.fused_stack.steps_run
    generate(llm, prompts(31, 1), None)
    assert model.fused_stack.steps_run > before
    assert model.fused_stack._lora is None  # a base-only step hands the stack no LoRA groups


# ---- refusals --------------------------------------------------------------------------------
def test_an_engine_without_lora_refuses_adapters(lora_models):
    llm = LLM(lora_models["path"], dtype="float32", kv_cache_memory=16 << 20)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=lora(lora_models, "all", 1))
    assert not llm.engine.has_unfinished_requests()


def test_a_refused_request_loads_no_adapter(lora_models):
    """The request's own checks (here n above max_num_seqs) run before its adapter loads."""
    llm = engine(lora_models, max_num_seqs=2)
    params = SamplingParams(n=3, temperature=0.5, max_tokens=4)
    with pytest.raises(ValueError, match="n must be at most max_num_seqs"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False, lora_request=lora(lora_models, "all", 1))
    assert llm.engine.list_loras() == set() and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("options, message", [
    ({"max_loras": 0}, "max_loras must be a positive integer"),
    ({"max_lora_rank": -1}, "max_lora_rank must be a positive integer"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras must be an integer >= max_loras"),
])
def test_bad_options_are_refused(lora_models, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(lora_models["path"], dtype="float32", enable_lora=True, **options)


def test_bad_adapters_are_refused_by_name(lora_models, tmp_path):
    root = lora_models["root"]
    llm = engine(lora_models, max_lora_rank=8)
    cases = [
        (LoRARequest("missing", 1, str(tmp_path / "nowhere")), "is not a directory"),
        (LoRARequest("rank", 2, str(root / "mlp")), "rank 16 .* above max_lora_rank 8"),
        (LoRARequest("dora", 3, str(edit_adapter_config(root / "all", tmp_path / "dora", use_dora=True))), "DoRA"),
        (LoRARequest("bias", 4, str(edit_adapter_config(root / "all", tmp_path / "bias", bias="all"))),
         "trained biases"),
        (LoRARequest("save", 5, str(edit_adapter_config(root / "all", tmp_path / "save", modules_to_save=["lm_head"]))),
         "modules_to_save"),
        (LoRARequest("alora", 7, str(edit_adapter_config(root / "all", tmp_path / "alora",
                                                         alora_invocation_tokens=[5, 6]))), "aLoRA"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=request)
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=lora(lora_models, "all", 6))
    with pytest.raises(ValueError, match="lora_int_id 6 is loaded from"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=lora(lora_models, "qv", 6))
    assert not llm.engine.has_unfinished_requests()
    assert list(llm.engine.lora.adapters) == [6]


def test_adapters_on_the_lm_head_are_refused(lora_models, tmp_path):
    from tests.lora.conftest import make_adapter

    make_adapter(lora_models["hf"], tmp_path / "head", 5, r=4, target_modules=["q_proj", "lm_head"])
    llm = engine(lora_models)
    with pytest.raises(ValueError, match="embedding or LM head"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("head", 1, str(tmp_path / "head")))


def test_lora_request_fields_are_checked():
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name must not be empty"):
        LoRARequest("", 1, "/x")


def test_distributed_layouts_are_refused(lora_models):
    with pytest.raises(ValueError, match="one rank only"):
        LLM(lora_models["path"], dtype="float32", enable_lora=True, tensor_parallel_size=2,
            kv_cache_memory=16 << 20)


def test_an_id_reused_for_another_folder_finds_none_of_the_old_blocks(lora_models):
    """The prefix cache keys an adapter by id and folder: unloading id 1 and loading another adapter
    under it must not serve the first one's K/V."""
    llm = engine(lora_models, block_size=4)
    prompt = prompts(37, 1, 40, 40)[0]
    generate(llm, [prompt], lora(lora_models, "all", 1))
    assert llm.engine.remove_lora(1)
    other = generate(llm, [prompt], LoRARequest("other", 1, str(lora_models["root"] / "qv")))[0]
    assert other.num_cached_tokens == 0
    assert_greedy_match(other.outputs[0].token_ids, *reference(lora_models, "qv", prompt), "reused id")


def test_alpha_pattern_matches_full_module_names(lora_models, tmp_path):
    """PEFT matches alpha_pattern keys against the full module name (model.layers.0.self_attn.q_proj)."""
    from tests.lora.conftest import make_adapter

    make_adapter(lora_models["hf"], tmp_path / "pat", 9, r=8, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                 alpha_pattern={"self_attn.q_proj": 64, r"layers\.1\.mlp\.down_proj": 2})
    import peft

    ref_model = peft.PeftModel.from_pretrained(lora_models["hf"].__class__.from_pretrained(lora_models["path"]),
                                               tmp_path / "pat").eval()
    llm = engine(lora_models)
    prompt = prompts(41, 1)[0]
    out = generate(llm, [prompt], LoRARequest("pat", 1, str(tmp_path / "pat")))[0]
    tokens, gaps, _ = hf_greedy(ref_model, prompt, NEW)
    assert_greedy_match(out.outputs[0].token_ids, tokens, gaps, "alpha_pattern")


def test_an_unreadable_weights_file_is_a_value_error(lora_models, tmp_path):
    import shutil

    bad = tmp_path / "corrupt"
    shutil.copytree(lora_models["root"] / "all", bad)
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    llm = engine(lora_models)
    with pytest.raises(ValueError, match="could not be read"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("c", 1, str(bad)))
    assert not llm.engine.list_loras()


def test_embeddings_run_with_their_adapter(lora_models):
    """An embedding request with an adapter pools PEFT's own hidden states, batched with the base
    model and another adapter (the same rows the generating path runs)."""
    import torch
    import torch.nn.functional as F

    from kvflow import PoolingParams

    llm = engine(lora_models, max_loras=2)
    batch = prompts(21, 3)
    names = ["all", None, "mlp"]
    ids = {"all": 1, "mlp": 3}
    outs = llm.encode([{"prompt_token_ids": p} for p in batch], PoolingParams(), use_tqdm=False,
                      lora_request=[None if n is None else lora(lora_models, n, ids[n]) for n in names])
    for name, prompt, out in zip(names, batch, outs):
        model = lora_models["hf"] if name is None else lora_models["peft"][name]
        with torch.no_grad():
            hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        torch.testing.assert_close(out.outputs.data, F.normalize(hidden.float(), dim=-1), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(outs[0].outputs.data, llm.encode({"prompt_token_ids": batch[0]}, use_tqdm=False)[0]
                              .outputs.data, atol=1e-3)  # the adapter changed the vector
