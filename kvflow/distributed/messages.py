"""What crosses the driver/worker boundary each step: one message out, one reply back.

The message is the scheduler's output flattened the way the runner flattens it for the model
(`ModelRunner.prepare_inputs`): token ids, positions, slot mapping, block tables, query
offsets, sequence lengths and the rows to sample, as numpy arrays: about 40 bytes per
scheduled token plus 8 per block-table entry, pickled once and written to each worker's pipe.
Workers never see a `Sequence`: sampling state (seeds, penalties, grammars) stays in the
driver. The reply comes from one rank (`ParallelConfig.output_rank`): the argmax token ids when
every sampled row is a bare greedy pick, else the float32 logits of the sampled rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.layers.attention import AttentionMetadata


@dataclass
class StepMessage:
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int64
    query_start: np.ndarray  # [num_seqs + 1] int64
    seq_lens: np.ndarray  # [num_seqs] int64
    num_decodes: int
    block_size: int
    logits_indices: np.ndarray  # [num_sampled_rows] int64
    argmax_only: bool  # reply with token ids, not logits

    @classmethod
    def from_model_input(cls, inputs, argmax_only: bool) -> "StepMessage":
        meta: AttentionMetadata = inputs.attn_metadata
        return cls(inputs.input_ids.numpy(), inputs.positions.numpy(), meta.slot_mapping.numpy(),
                   meta.block_tables.numpy(), meta.query_start_tensor.numpy(), meta.seq_lens_tensor.numpy(),
                   meta.num_decodes, meta.block_size, inputs.logits_indices.numpy(), argmax_only)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def attn_metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(self.slot_mapping),
            query_start_loc=self.query_start.tolist(),
            seq_lens=self.seq_lens.tolist(),
            block_tables=torch.from_numpy(self.block_tables),
            num_decodes=self.num_decodes,
            block_size=self.block_size,
            query_start_tensor=torch.from_numpy(self.query_start),
            seq_lens_tensor=torch.from_numpy(self.seq_lens),
        )


@dataclass
class StepResult:
    token_ids: list[int] | None = None  # argmax_only
    logits: torch.Tensor | None = None  # [num_sampled_rows, vocab] float32 otherwise
