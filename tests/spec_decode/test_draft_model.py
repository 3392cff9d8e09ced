"""The draft-model proposer: exact greedy output, its own pool kept whole, bad drafts refused."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.entrypoints.cli import main
from tests.conftest import save_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    """A random target, and as its draft the same weights under noise: often right, often wrong."""
    target, hf = save_tiny_llama(tmp_path_factory.mktemp("target"), seed=77)
    generator = torch.Generator().manual_seed(78)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.03)
    draft = tmp_path_factory.mktemp("draft")
    hf.save_pretrained(draft, safe_serialization=True)
    return target, str(draft)


@pytest.fixture(scope="module")
def target(models) -> str:
    return models[0]


@pytest.fixture(scope="module")
def draft(models) -> str:
    return models[1]


def _prompts(n: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 320, int(rng.integers(5, 70))).tolist() for _ in range(n)]


def _run(llm: LLM, params=GREEDY) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    llm.engine.check_integrity()
    for kv in (llm.engine.kv_cache_manager, llm.engine.speculator.draft.kv if llm.engine.speculator else None):
        if kv is not None:
            kv.check_integrity()
            assert kv.num_free_blocks == kv.num_blocks, "blocks were not all returned to the pool"
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _spec(draft_path: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": draft_path, "num_speculative_tokens": k, "disable_by_batch_size": None,
            "min_mean_accepted": 0.0}


@pytest.mark.parametrize("layout", [{}, {"max_num_batched_tokens": 9}, {"block_size": 1}])
def test_greedy_equals_plain_decoding(target, draft, layout):
    plain = _run(LLM(target, dtype="float32", **layout))
    llm = LLM(target, dtype="float32", speculative_config=_spec(draft), **layout)
    assert _run(llm) == plain
    stats = llm.engine.get_stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("quantization", [None, "none"])  # "none" asks for the float draft by name
def test_the_target_as_its_own_draft_is_always_right(target, quantization):
    spec = _spec(target, k=4) | ({"quantization": quantization} if quantization else {})
    llm = LLM(target, dtype="float32", speculative_config=spec)
    assert _run(llm) == _run(LLM(target, dtype="float32"))
    stats = llm.engine.get_stats().spec_decode
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


@pytest.mark.parametrize("self_draft", [False, True], ids=["draft", "int4-self-draft"])
def test_seeded_sampling_repeats(target, draft, self_draft):
    params = SamplingParams(temperature=0.7, seed=9, max_tokens=20)
    spec = {**_spec(target), "quantization": "int4"} if self_draft else _spec(draft)
    llm = LLM(target, dtype="float32", speculative_config=spec)
    first = _run(llm, params)
    assert _run(llm, params) == first
    assert llm.engine.get_stats().spec_decode.num_draft_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused(target, tmp_path):
    other = save_tiny_llama(tmp_path / "other", vocab_size=300)[0]
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary has 300"):
        LLM(target, dtype="float32", speculative_config=_spec(other))
    with pytest.raises(ValueError, match="speculative_config.model: .*does not exist"):
        LLM(target, dtype="float32", speculative_config=_spec(str(tmp_path / "missing")))


def test_a_draft_with_a_shorter_context_is_refused(target, tmp_path):
    short = save_tiny_llama(tmp_path / "s", max_position_embeddings=256)[0]
    with pytest.raises(ValueError, match="speculative_config.model: the draft attends over 256 positions"):
        LLM(target, dtype="float32", speculative_config=_spec(short))
    LLM(target, dtype="float32", max_model_len=256, kv_cache_memory=1 << 20, speculative_config=_spec(short))


def test_a_draft_that_does_not_fit_the_memory_plan_is_refused(target, draft):
    alone = LLM(target, dtype="float32", kv_cache_memory=1 << 20, max_model_len=1024).engine.plan
    budget = 1024 * alone.bytes_per_token + 1024  # the target alone fits one full sequence...
    LLM(target, dtype="float32", kv_cache_memory=budget, max_model_len=1024)
    with pytest.raises(ValueError, match=r"speculative_config.model"):  # ...the draft's KV beside it does not
        LLM(target, dtype="float32", kv_cache_memory=budget, max_model_len=1024, speculative_config=_spec(draft))


def test_plan_reports_the_draft(target, draft, capsys):
    import json

    assert main(["plan", "--model", target, "--dtype", "float32", "--kv-cache-memory", "8MiB",
                 "--speculative-config", json.dumps(_spec(draft))]) == 0
    out = capsys.readouterr().out
    assert "draft weights" in out and "draft KV cache" in out


def test_quantized_self_draft(target):
    """The target's own weights in int4 as the draft: greedy output as without speculation,
    and the draft agrees with its full-precision self far more often than chance (1 in 320);
    on this tiny random model about 45 % of its guesses are kept."""
    plain = _run(LLM(target, dtype="float32", kv_cache_memory=1 << 20))
    spec = {**_spec(target), "quantization": "int4"}
    llm = LLM(target, dtype="float32", kv_cache_memory=1 << 20, speculative_config=spec)
    draft_model = llm.engine.speculator.draft.runner.model
    assert draft_model.layers[0].mlp.down_proj.quant_weight.source == "int4"
    assert draft_model.lm_head.quant_weight is not None  # the draft's head too, by default
    assert llm.engine.runner.model.layers[0].mlp.down_proj.quant_weight is None
    assert [t for t, _ in _run(llm)] == [t for t, _ in plain]
    stats = llm.engine.get_stats().spec_decode
    assert stats.num_accepted_tokens > 0.25 * stats.num_draft_tokens


def test_draft_lm_head_stays_when_asked(target):
    spec = {**_spec(target), "quantization": "int8", "quantize_lm_head": False}
    llm = LLM(target, dtype="float32", kv_cache_memory=1 << 20, speculative_config=spec)
    assert llm.engine.speculator.draft.runner.model.lm_head.quant_weight is None


def test_draft_quantization_refused_by_name():
    with pytest.raises(ValueError, match="speculative_config.quantization: 'int5' is not supported"):
        LLM(speculative_config={"method": "draft_model", "model": "x", "num_speculative_tokens": 2,
                                "quantization": "int5"})


def test_a_self_draft_runs_on_the_targets_cache(target, draft, capsys):
    """The target's own checkpoint as the draft reads and writes the target's pool (no cache, no
    prefill of its own), so the target keeps the whole KV budget; another draft keeps its own."""
    import json

    spec = {**_spec(target), "quantization": "int4"}
    llm = LLM(target, dtype="float32", kv_cache_memory=1 << 20, speculative_config=spec)
    proposer = llm.engine.speculator.draft
    assert proposer.shares_target_kv and proposer.kv is llm.engine.kv_cache_manager
    assert proposer.runner.kv_caches is llm.engine.runner.kv_caches
    alone = LLM(target, dtype="float32", kv_cache_memory=1 << 20).engine.plan
    assert llm.engine.plan.num_blocks == alone.num_blocks
    other = LLM(target, dtype="float32", kv_cache_memory=1 << 20, speculative_config=_spec(draft))
    assert not other.engine.speculator.draft.shares_target_kv
    assert other.engine.plan.num_blocks < alone.num_blocks
    assert main(["plan", "--model", target, "--dtype", "float32", "--kv-cache-memory", "8MiB",
                 "--speculative-config", json.dumps(spec)]) == 0
    assert re.search(r"draft KV cache +the target's", capsys.readouterr().out)


@pytest.mark.parametrize("layout", [{"max_num_batched_tokens": 9, "block_size": 4},
                                    {"block_size": 1, "kv_cache_memory": 200 * 512, "max_model_len": 192},
                                    {"kv_cache_dtype": "int8"}],
                         ids=["chunked", "tight-pool", "int8-kv"])
def test_a_self_draft_keeps_the_pool_whole_after_every_step(target, layout):
    """Stepping by hand: after every step each running sequence holds exactly the blocks of its
    computed tokens (the draft's guess blocks went back), the pool's counts agree, and greedy
    output equals plain decoding, with chunked prefill, prefix caching and preemption mixed in."""
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.config import EngineConfig

    prompts = _prompts()
    prompts[3] = prompts[1][:40] + prompts[3]  # a shared prefix for the prefix cache

    def generate(spec) -> tuple[dict, int]:
        engine = LLMEngine(EngineConfig(model=target, dtype="float32", speculative_config=spec, **layout))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            engine.check_integrity()
            kv = engine.kv_cache_manager
            for seq in engine.scheduler.running:
                assert len(kv.block_table(seq.request_id)) == kv.blocks_needed(seq.num_computed_tokens)
        assert kv.num_free_blocks == kv.num_blocks
        if spec is not None:
            assert engine.get_stats().spec_decode.num_accepted_tokens > 0
        return done, engine.scheduler.num_preemptions

    plain, _ = generate(None)
    spec, preemptions = generate({**_spec(target), "quantization": "int4"})
    assert spec == plain
    if "kv_cache_memory" in layout:
        assert preemptions > 0, "the tight pool was meant to preempt"


def test_one_row_self_draft_steps_run_on_the_vector_units(target):
    """A self-draft's one-row forwards run on the vector units (`_units_for`: faster for 4-bit
    groups than AMX tiles), wider ones as the target does; the bf16 target's greedy output is
    unchanged either way, at batch 1 and batch 3."""
    from kvflow.layers import cpu_kernels
    from kvflow.spec_decode.draft_model import _units_for
    from tests.layers.test_gemm import amx_mode, amx_telltale_rows

    kernels = cpu_kernels.load()
    if kernels is None or not kernels.has_gemm(torch.bfloat16):
        pytest.skip("no bf16 CPU kernels here")
    with amx_mode(kernels, "auto"):
        packed = kernels.pack_weight(torch.ones(16, 64, dtype=torch.bfloat16))
        summed = lambda: kernels.gemm(amx_telltale_rows(1, 64), packed, 16).float().unique().tolist()  # noqa: E731
        with _units_for(1):
            assert summed() == [0.0]  # vdpbf16ps's chain
        with _units_for(2):
            assert summed() == [32.0]  # the tile unit
        prompts = [[5, 9, 13], [7, 7, 2, 40], [11]]
        plain = LLM(target, dtype="bfloat16", kv_cache_memory=1 << 20)
        llm = LLM(target, dtype="bfloat16", kv_cache_memory=1 << 20,
                  speculative_config={**_spec(target), "quantization": "int4"})
        for batch in ([prompts[0]], prompts):
            want = [o.outputs[0].token_ids for o in plain.generate(batch, GREEDY)]
            assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)] == want
        assert llm.engine.get_stats().spec_decode.num_draft_tokens > 0
