"""Embeddings (`LLM.embed`/`encode`) against transformers' own hidden states in float32, and the
same vector whatever the batch, chunking, prefix cache or preemption around it."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvflow import LLM, PoolingParams, SamplingParams
from tests.conftest import assert_greedy_match, hf_greedy


def prompts(seed: int, count: int, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def hf_vector(hf, ids: list[int], pooling: str = "LAST", normalize: bool = True, dims: int | None = None):
    """The reference: transformers' final-norm hidden states, pooled and normalised by hand."""
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].to(torch.float32)
    vector = hidden[-1] if pooling == "LAST" else hidden.to(torch.float64).mean(dim=0).to(torch.float32)
    vector = vector[:dims] if dims else vector
    return F.normalize(vector, dim=-1) if normalize else vector


def embed(llm: LLM, ps: list[list[int]], params=None) -> list[torch.Tensor]:
    outs = llm.encode([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert all(o.finished for o in outs)
    return [o.outputs.data for o in outs]


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("llama")


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
@pytest.mark.parametrize("normalize", [True, False])
def test_matches_transformers(tiny, pooling, normalize):
    path, hf = tiny
    ps = prompts(1, 6)
    llm = LLM(path, dtype="float32", pooler_config={"pooling_type": pooling, "normalize": normalize})
    for p, got in zip(ps, embed(llm, ps)):
        torch.testing.assert_close(got, hf_vector(hf, p, pooling, normalize), rtol=1e-4, atol=1e-5)
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.kv_cache_manager.num_blocks


def test_request_overrides_normalize(tiny):
    path, hf = tiny
    p = prompts(2, 1)[0]
    llm = LLM(path, dtype="float32")
    raw, = embed(llm, [p], PoolingParams(normalize=False))
    torch.testing.assert_close(raw, hf_vector(hf, p, normalize=False), rtol=1e-4, atol=1e-5)
    # Its own memory, not a view that keeps the step's hidden states of every prompt token alive.
    assert raw.untyped_storage().nbytes() == raw.numel() * raw.element_size()
    unit, = embed(llm, [p])
    assert abs(float(unit.norm()) - 1.0) < 1e-5


def test_default_model_matches_transformers(smollm2_fp32, hf_smollm2):
    texts = ["Hello world, this is a test.", "The capital of France is Paris.", "def add(a, b):\n    return a + b"]
    outs = smollm2_fp32.embed(texts, use_tqdm=False)
    tokenizer = smollm2_fp32.get_tokenizer()
    for text, out in zip(texts, outs):
        ids = tokenizer(text).input_ids
        assert out.prompt_token_ids == ids
        assert len(out.outputs.embedding) == out.outputs.hidden_size == 576
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), hf_vector(hf_smollm2, ids),
                                   rtol=1e-3, atol=2e-5)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
@pytest.mark.parametrize("config", [
    dict(max_num_batched_tokens=16),  # prompts chunked
    dict(max_num_seqs=2, enable_prefix_caching=False),
    dict(block_size=5),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_same_vector_in_any_batch(tiny, pooling, config):
    """Alone, batched, chunked: the vector is the same (the MEAN sum runs in float64 across chunks)."""
    path, _ = tiny
    ps = prompts(3, 8)
    pooler = {"pooling_type": pooling}
    alone = [embed(LLM(path, dtype="float32", pooler_config=pooler), [p])[0] for p in ps[:3]]
    batched = embed(LLM(path, dtype="float32", pooler_config=pooler, **config), ps)
    for a, b in zip(alone, batched):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_prefix_cache(tiny, pooling):
    """LAST may take every position but the last from the cache; MEAN needs them all, so it takes none,
    and its blocks still serve a later generation request."""
    path, hf = tiny
    p = prompts(4, 1, 40, 40)[0]
    llm = LLM(path, dtype="float32", pooler_config={"pooling_type": pooling})
    first = llm.encode({"prompt_token_ids": p}, use_tqdm=False)[0]
    again = llm.encode({"prompt_token_ids": p}, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (32 if pooling == "LAST" else 0)
    torch.testing.assert_close(again.outputs.data, first.outputs.data, rtol=2e-6, atol=2e-7)
    gen = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert gen.num_cached_tokens == 32


def test_mixed_with_generation(tiny):
    """Embedding and generation requests in one batch: tokens as transformers', vectors as alone."""
    path, hf = tiny
    gen_prompts, emb_prompts = prompts(5, 4), prompts(6, 4)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, (g, e) in enumerate(zip(gen_prompts, emb_prompts)):
        engine.add_request(f"g{i}", {"prompt_token_ids": g}, params)
        engine.add_request(f"e{i}", {"prompt_token_ids": e}, PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
    for i, g in enumerate(gen_prompts):
        ref, gaps = hf_greedy(hf, g, 10)[:2]
        assert_greedy_match(done[f"g{i}"].outputs[0].token_ids, ref, gaps, f"g{i}")
    for i, e in enumerate(emb_prompts):
        torch.testing.assert_close(done[f"e{i}"].outputs.data, hf_vector(hf, e), rtol=1e-4, atol=1e-5)
    engine.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_preempted_embeddings_keep_their_vectors(tiny, pooling):
    """Long embedding prompts, chunked, behind generation requests in a cache for about two
    requests: they are preempted part-way and recomputed, and each position is pooled once."""
    path, hf = tiny
    gen_prompts, emb_prompts = prompts(7, 6, 10, 30), prompts(8, 6, 60, 76)
    max_model_len = 80
    probe = LLM(path, dtype="float32", kv_cache_memory=1 << 20, max_model_len=max_model_len)
    budget = 2 * max_model_len * probe.engine.plan.bytes_per_token
    llm = LLM(path, dtype="float32", kv_cache_memory=budget, max_model_len=max_model_len, max_num_batched_tokens=16,
              pooler_config={"pooling_type": pooling})
    engine = llm.engine
    engine.scheduler.config.admission_headroom_blocks = 0
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, (g, e) in enumerate(zip(gen_prompts, emb_prompts)):
        engine.add_request(f"g{i}", {"prompt_token_ids": g}, params)
        engine.add_request(f"e{i}", {"prompt_token_ids": e}, PoolingParams(), priority=1)  # preempted first
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sum(done[f"e{i}"].metrics.num_preemptions for i in range(6)) > 0
    for i, e in enumerate(emb_prompts):
        torch.testing.assert_close(done[f"e{i}"].outputs.data, hf_vector(hf, e, pooling), rtol=1e-4, atol=1e-5)
    engine.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_abort_mid_prompt_returns_blocks(tiny):
    path, _ = tiny
    llm = LLM(path, dtype="float32", max_num_batched_tokens=8, pooler_config={"pooling_type": "MEAN"})
    engine = llm.engine
    engine.add_request("e", {"prompt_token_ids": prompts(9, 1, 60, 60)[0]}, PoolingParams())
    assert engine.step() == []  # one chunk of eight: nothing finished
    assert engine.abort_request("e")
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_prompt_may_fill_max_model_len(tiny):
    """Nothing is generated, so the prompt may take every position (a generation request may not)."""
    path, hf = tiny
    llm = LLM(path, dtype="float32", max_model_len=48)
    p = prompts(10, 1, 48, 48)[0]
    torch.testing.assert_close(embed(llm, [p])[0], hf_vector(hf, p), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="max_model_len is 48"):
        embed(llm, [p + [5]])
    with pytest.raises(ValueError, match="prompt plus at least one generated token"):
        llm.generate({"prompt_token_ids": p}, use_tqdm=False)


def test_truncate_prompt_tokens_as_vllms_keyword(tiny):
    """LLM.embed/encode(..., truncate_prompt_tokens=k): the prompt's last k tokens, as vLLM takes it."""
    path, hf = tiny
    llm = LLM(path, dtype="float32", max_model_len=48)
    p = prompts(11, 1, 60, 60)[0]  # longer than the model: refused unless cut
    got = llm.embed({"prompt_token_ids": p}, use_tqdm=False, truncate_prompt_tokens=20)[0]
    assert got.prompt_token_ids == p[-20:]
    torch.testing.assert_close(torch.tensor(got.outputs.embedding), hf_vector(hf, p[-20:]), rtol=1e-4, atol=1e-5)
    same = llm.encode({"prompt_token_ids": p}, PoolingParams(truncate_prompt_tokens=20), use_tqdm=False,
                      truncate_prompt_tokens=20)[0]
    assert same.outputs.data.tolist() == got.outputs.embedding
    with pytest.raises(ValueError, match="truncate_prompt_tokens: given both"):
        llm.encode({"prompt_token_ids": p}, PoolingParams(truncate_prompt_tokens=10), truncate_prompt_tokens=20)


@pytest.fixture(scope="module")
def matryoshka(tiny, tmp_path_factory):
    """The tiny model's folder with a config.json that declares Matryoshka dimensions."""
    path, hf = tiny
    folder = tmp_path_factory.mktemp("matryoshka")
    shutil.copytree(path, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder), hf


def test_matryoshka_dimensions(matryoshka):
    path, hf = matryoshka
    p = prompts(11, 1)[0]
    llm = LLM(path, dtype="float32")
    got, = embed(llm, [p], PoolingParams(dimensions=32))
    assert got.shape == (32,)
    torch.testing.assert_close(got, hf_vector(hf, p, dims=32), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="dimensions: 24 is not one the model was trained for; choose one of 16, 32, 64"):
        embed(llm, [p], PoolingParams(dimensions=24))


@pytest.mark.parametrize("params, message", [
    (PoolingParams(dimensions=32), "does not support Matryoshka embeddings"),
    (PoolingParams(dimensions=0), "dimensions must be a positive integer"),
    (PoolingParams(normalize="yes"), "normalize must be true, false or null"),
])
def test_refused_params(tiny, params, message):
    path, _ = tiny
    llm = LLM(path, dtype="float32")
    with pytest.raises(ValueError, match=message):
        embed(llm, [[5, 6, 7]], params)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("value, message", [
    ({"pooling_type": "CLS"}, "pooling_type 'CLS' is not supported; choose one of LAST, MEAN"),
    ({"pooling": "MEAN"}, "unknown field"),
    ("{not json", "not valid JSON"),
    ({"normalize": 1}, "normalize must be true or false"),
])
def test_refused_pooler_config(value, message):
    from kvflow import EngineConfig

    with pytest.raises(ValueError, match=f"pooler_config: .*{message}"):
        EngineConfig(pooler_config=value)


def test_with_speculative_decoding(tiny):
    """Embeddings beside speculating requests: nothing is drafted for them, vectors unchanged."""
    path, hf = tiny
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    engine = llm.engine
    gen = [p * 3 for p in prompts(12, 3, 4, 8)]  # repetitive: the n-gram proposer drafts
    emb = prompts(13, 3, 17, 33)
    for i, (g, e) in enumerate(zip(gen, emb)):
        engine.add_request(f"g{i}", {"prompt_token_ids": g}, SamplingParams(temperature=0, max_tokens=12,
                                                                             ignore_eos=True))
        engine.add_request(f"e{i}", {"prompt_token_ids": e}, PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.speculator.stats.num_draft_tokens > 0
    for i, e in enumerate(emb):
        torch.testing.assert_close(done[f"e{i}"].outputs.data, hf_vector(hf, e), rtol=1e-4, atol=1e-5)
    for i, g in enumerate(gen):
        ref, gaps = hf_greedy(hf, g, 12)[:2]
        assert_greedy_match(done[f"g{i}"].outputs[0].token_ids, ref, gaps, f"g{i}")
