"""Which decode steps replay a CUDA graph, and the padding they get. Capturing and replaying need a
GPU: scripts/gpu_check runs tests/engine/test_cuda_backend.py there with graphs on and off."""

from __future__ import annotations

import torch

from kvflow.engine.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from kvflow.layers.attention import AttentionMetadata


def test_capture_sizes_cover_the_scheduler_and_pad_to_the_next_one():
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1000)[-1] == 256  # larger decode batches run eagerly
    sizes = capture_sizes(64)
    assert [padded_size(sizes, n) for n in (1, 3, 17, 64, 65)] == [1, 4, 24, 64, None]


def _meta(num_seqs: int, num_decodes: int, width: int) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=torch.zeros(num_seqs, dtype=torch.int64),
                             query_start_loc=list(range(num_seqs + 1)), seq_lens=[1] * num_seqs,
                             block_tables=torch.zeros(num_seqs, width, dtype=torch.int64),
                             num_decodes=num_decodes, block_size=16)


def test_only_pure_decode_steps_of_a_captured_size_replay():
    graphs = DecodeGraphs(lambda *a: None, torch.device("cpu"), block_size=16, max_model_len=100, max_num_seqs=8)
    assert graphs.width == 7 and graphs.slot_mapping.tolist() == [-1] * 8  # padding until filled
    assert graphs.fits(_meta(5, 5, 7))
    assert not graphs.fits(_meta(5, 4, 7))  # a prefill chunk among them: eager
    assert not graphs.fits(_meta(9, 9, 7))  # above the largest size: eager


class _EagerReplay:
    """Stands in for a captured graph on the CPU: a replay reruns the forward on the static buffers
    and writes into the captured output, as a real replay does."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size
        self.output = graphs.forward(graphs.input_ids[:size], graphs.positions[:size], graphs._meta(size))
        self.replays = 0

    def replay(self) -> None:
        g = self.graphs
        self.output.copy_(g.forward(g.input_ids[: self.size], g.positions[: self.size], g._meta(self.size)))
        self.replays += 1

    def pool(self):
        return None


def test_replays_with_padded_rows_give_the_eager_tokens(tmp_path, monkeypatch):
    """The runner's replay path (static buffers, padding rows with slot -1 and length 0, a grid
    sized for max_model_len) through the real model and the CUDA backend's kernels, with each
    replay rerun eagerly: the greedy tokens are the CPU backend's, and no padded row touched a block."""
    from kvflow import LLM, SamplingParams
    from tests.conftest import save_tiny_llama
    from tests.layers.triton.interpreter import DEVICE, load_kernels

    if DEVICE == "cuda":
        import pytest

        pytest.skip("on a GPU, tests/engine/test_cuda_greedy.py replays real graphs")
    load_kernels()
    from kvflow.layers.cuda_attention import CUDAAttentionBackend

    path = save_tiny_llama(tmp_path / "tiny")[0]
    prompts = [[5, 9, 13, 200, 7], list(range(20, 57)), [300, 4, 4, 8, 90, 91, 17, 3, 66]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", device="cpu").generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    monkeypatch.setattr("kvflow.engine.model_placement.get_attn_backend", lambda device: CUDAAttentionBackend("cpu"))
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=96)
    runner = llm.engine.runner
    graphs = DecodeGraphs(lambda ids, pos, meta: runner.model(ids, pos, runner.kv_caches, meta),
                          torch.device("cpu"), runner.block_size, 96, max_num_seqs=4)
    monkeypatch.setattr(graphs, "_capture_one", lambda size, pool: (r := _EagerReplay(graphs, size), r.output))
    graphs.capture()
    runner.decode_graphs = graphs
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert graphs.graphs[4].replays > 0  # three sequences decoded as a padded batch of four
    kv = llm.engine.kv_cache_manager
    llm.engine.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
