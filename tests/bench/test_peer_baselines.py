"""scripts/peer_baselines: the peers must time exactly kvflow's workloads, and the llama.cpp
driver must feed every sequence its own tokens at its own positions. The peers themselves
(OpenVINO, llama.cpp) live in venvs of their own, so llama_cpp is stubbed here: what is tested
is the batching logic around it, not llama.cpp."""

import importlib
import sys
import types
from pathlib import Path

import pytest

from kvflow.bench.datasets import random_requests
from kvflow.bench.latency import prompts as latency_prompts

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "peer_baselines"


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("common")


@pytest.fixture
def llamacpp(common, monkeypatch):
    stub = types.ModuleType("llama_cpp")
    stub.LLAMA_FLASH_ATTN_TYPE_AUTO, stub.LLAMA_FLASH_ATTN_TYPE_DISABLED, stub.LLAMA_FLASH_ATTN_TYPE_ENABLED = -1, 0, 1
    monkeypatch.setitem(sys.modules, "llama_cpp", stub)
    monkeypatch.delitem(sys.modules, "run_llamacpp", raising=False)
    return importlib.import_module("run_llamacpp")


@pytest.mark.parametrize("seed", [0, 1000, 2000, 100])
def test_offline_draws_are_kvflows(common, seed):
    prompts, out_lens = common.offline_requests(seed, smoke=False)
    ref = random_requests(seed=seed)
    assert prompts == [r.prompt_token_ids for r in ref]
    assert out_lens == [r.output_len for r in ref]
    if seed == 0:  # the workload README's totals
        assert (sum(map(len, prompts)), sum(out_lens)) == (9120, 4555)


def test_latency_prompts_are_kvflows_and_fresh(common):
    for seed in (1, 1001, 2001):
        prompt, n_out = common.latency_request(seed, smoke=False)
        assert prompt == latency_prompts(seed, 1, 128, (1000, 40000))[0] and n_out == 128
    args = common.parser("t").parse_args([])
    assert common.offline_seeds(args) == [0, 1000, 2000]
    assert common.latency_seeds(args) == [1, 1001, 2001]
    timed = {tuple(common.latency_request(s, False)[0]) for s in common.latency_seeds(args)}
    assert tuple(common.latency_request(common.WARMUP_SEED, False)[0]) not in timed and len(timed) == 3


def test_smoke_is_tiny(common):
    args = common.parser("t").parse_args(["--smoke", "--repeat", "5"])
    prompts, out_lens = common.offline_requests(0, smoke=True)
    assert len(prompts) == 2 and max(out_lens) == 8
    assert common.offline_seeds(args) == [0] and common.latency_request(1, True)[1] == 8


def test_figures(common, capsys):
    prompts, out_lens = [[1] * 10, [2] * 30], [5, 5]
    fig = common.offline_figure({"engine": "x"}, 0, prompts, out_lens, 10, 2.0, smoke=False)
    assert (fig["total_tok_s"], fig["output_tok_s"], fig["prompt_tokens"]) == (25.0, 5.0, 40)
    with pytest.raises(SystemExit, match="generated 9 tokens, expected 10"):
        common.offline_figure({}, 0, prompts, out_lens, 9, 2.0, smoke=False)
    lat = common.latency_figure({}, 1, 0.0, [0.1, 0.11, 0.13], 3, smoke=False)
    assert lat["ttft_ms"] == 100.0 and lat["mean_itl_ms"] == pytest.approx(15.0)
    with pytest.raises(SystemExit, match="got 2 tokens"):
        common.latency_figure({}, 1, 0.0, [0.1, 0.2], 3, smoke=False)
    common.emit_median([dict(lat, seed=1), dict(lat, seed=1001, ttft_ms=300.0), dict(lat, seed=2001, ttft_ms=200.0)],
                       ("ttft_ms", "mean_itl_ms", "peak_rss_gb"))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert '"seed": "median"' in line and '"ttft_ms": 200.0' in line and '"seeds": [1, 1001, 2001]' in line


class FakeEngine:
    """Records what each sequence was fed; the 'logits' pick a token from (sequence, position)."""

    def __init__(self, n_batch, unified, n_ctx=16384, n_seq=32):
        self.n_batch, self.n_ctx = n_batch, n_ctx
        self.config = {"kv_unified": unified, "n_seq_max": n_seq}
        self.fed, self.calls = {}, []

    def clear(self):
        self.fed = {}

    def decode(self, tokens, positions, seqs, wants):
        assert len(tokens) <= self.n_batch
        self.calls.append(sorted(set(seqs)))
        out = []
        for tok, pos, seq, want in zip(tokens, positions, seqs, wants):
            self.fed.setdefault(seq, []).append((pos, tok))
            if want:
                out.append(50_000 + 100 * seq + pos)
        return out


@pytest.mark.parametrize("unified", [True, False])
def test_llamacpp_batch_feeds_each_sequence_its_own_tokens(llamacpp, unified):
    prompts = [[7] * 300, [8] * 5, [9] * 40]
    out_lens = [3, 6, 1]
    eng = FakeEngine(n_batch=128, unified=unified)
    generated = llamacpp.generate_batch(eng, prompts, out_lens)
    assert [len(g) for g in generated] == out_lens
    for s, (p, n) in enumerate(zip(prompts, out_lens)):
        expected_gen = [50_000 + 100 * s + pos for pos in range(len(p) - 1, len(p) + n - 1)]
        assert generated[s] == expected_gen
        # every position once, in order, the prompt then all generated tokens but the last
        assert eng.fed[s] == list(enumerate(p + expected_gen[:-1]))
    if not unified:  # per-sequence KV streams: no prompt chunk mixes sequences
        prefill = [c for c in eng.calls if len(c) == 1]
        assert len(prefill) >= 3 + 300 // 128


def test_llamacpp_refuses_a_draw_that_does_not_fit(llamacpp):
    eng = FakeEngine(n_batch=128, unified=True, n_ctx=100)
    with pytest.raises(SystemExit, match="n_ctx >= 110"):
        llamacpp.generate_batch(eng, [[1] * 50, [2] * 50], [5, 5])


def test_llamacpp_stream_one_walks_positions(llamacpp):
    eng = FakeEngine(n_batch=256, unified=True)
    start, times, tokens = llamacpp.stream_one(eng, [5] * 128, 4)
    assert len(times) == 4 and times[0] >= start and times == sorted(times)
    assert tokens == [50_000 + pos for pos in range(127, 131)]
    assert eng.fed[0] == list(enumerate([5] * 128 + tokens[:-1]))


@pytest.mark.parametrize("seed", [4, 5, 6, 104])
def test_embed_draws_are_kvflows(monkeypatch, seed):
    """The OpenVINO embedding script times exactly `kvflow bench embed`'s W-embed draws."""
    from kvflow.bench.embed import embed_prompts

    monkeypatch.syspath_prepend(str(SCRIPTS))
    script = importlib.import_module("run_openvino_embed")
    assert script.embed_draw(seed) == embed_prompts(64, 16, 256, seed, (1000, 40000))
