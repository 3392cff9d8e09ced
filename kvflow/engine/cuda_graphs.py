"""CUDA graphs for decode steps: captured once per batch size, replayed with padded inputs.

A decode step of a small batch launches hundreds of kernels (a few per layer) whose launch
cost, not their work, sets the step time. A CUDA graph records the whole model forward of one
batch size once and replays it with one launch. What makes the replay valid for any later step:

- every input lives in a static buffer the graph reads (token ids, positions, slot mapping,
  block tables of `max_model_len / block_size` entries, lengths), refilled before each replay;
- the attention kernels' grids depend only on the batch size and `max_model_len`
  (`AttentionMetadata.max_decode_seq_len`), never on the lengths;
- a batch of n sequences replays the smallest captured size >= n; the padded rows get slot -1
  (the KV store skips them) and length 0 (attention writes zeros), so they touch no block.

Prefill and mixed steps, and decode batches above the largest size, run eagerly. The LM head
and the sampler stay outside the graph (they see only the real rows).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from kvflow.layers.attention import AttentionMetadata

logger = logging.getLogger("kvflow")

# vLLM-like buckets: every small size, then steps that keep padding under a third.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture for a scheduler that runs at most max_num_seqs sequences."""
    sizes = [s for s in CAPTURE_SIZES if s <= max_num_seqs]
    if max_num_seqs <= CAPTURE_SIZES[-1] and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


def padded_size(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest captured size that holds num_seqs rows, or None (run eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """The captured decode forwards of one model and KV pool."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 device: torch.device, block_size: int, max_model_len: int, max_num_seqs: int) -> None:
        self.forward, self.device, self.block_size, self.max_model_len = forward, device, block_size, max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.width = -(-max_model_len // block_size)
        zeros = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **zeros)
        self.positions = torch.zeros(n, **zeros)
        self.slot_mapping = torch.full((n,), -1, **zeros)
        self.block_tables = torch.zeros((n, self.width), **zeros)
        self.seq_lens = torch.zeros(n, **zeros)
        self.query_start = torch.arange(n + 1, **zeros)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=list(range(size + 1)), seq_lens=[1] * size,
            block_tables=self.block_tables[:size], num_decodes=size, block_size=self.block_size,
            query_start_tensor=self.query_start[: size + 1], seq_lens_tensor=self.seq_lens[:size],
            max_decode_seq_len=self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool. The buffers hold padding
        (slot -1, length 0) meanwhile, so capturing writes no KV block."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self.graphs[size], self.outputs[size] = self._capture_one(size, pool)
            pool = self.graphs[size].pool()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("kvflow: captured CUDA graphs for decode batch sizes %s in %.1f s", self.sizes,
                    time.perf_counter() - start)

    def _capture_one(self, size: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        meta = self._meta(size)
        for _ in range(2):  # compiles the Triton kernels and settles cuBLAS' choices outside the graph
            self.forward(self.input_ids[:size], self.positions[:size], meta)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = self.forward(self.input_ids[:size], self.positions[:size], meta)
        return graph, output

    def fits(self, meta: AttentionMetadata) -> bool:
        """A pure decode step of a captured size whose block tables fit the static buffer."""
        return (meta.num_decodes == meta.num_seqs and padded_size(self.sizes, meta.num_seqs) is not None
                and meta.block_tables.shape[1] <= self.width)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the step's n rows (host tensors in, device rows out)."""
        n = meta.num_seqs
        size = padded_size(self.sizes, n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens_tensor, non_blocking=True)
        if size > n:  # padding: no KV write, no attention (stale table entries past a length are never read)
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:n]
