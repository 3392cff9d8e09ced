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
