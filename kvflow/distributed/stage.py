"""One rank's forward pass: its layer range of its tensor-parallel share of the model.

The first stage embeds the tokens (vocab-parallel); later stages receive the hidden state and
the residual stream from the previous stage (one send of both, [2, tokens, hidden]); the last
stage applies the final norm and the LM head to the sampled rows only, and its TP rank 0 has
the full logits. With tensor_parallel_size 1 a stage's layers run as one C++ call (the fused
stack of `models/llama_fused.py` over the stage's range, bit for bit the modules), where the
model and the CPU allow it. With T > 1 they are the model's own modules, on the per-module
path (`models/llama.py`), with the row-parallel projections wrapped (`layers.RowParallel`):
the fused stack cannot stop mid-layer for an all-reduce. The CPU kernels (GEMM, attention,
norms) run inside each module, on the rank's shard.

Pipeline schedule: the driver keeps P batches in flight (engine/batch_queue.py), and every
rank runs the steps it is sent in order, so stage 1 computes batch B while stage 2 computes
batch A; a stage's send of batch B's hidden state waits until the next stage takes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kvflow.config import ModelConfig
from kvflow.distributed.layers import vocab_parallel_embedding, vocab_parallel_logits
from kvflow.distributed.messages import StepMessage, StepResult
from kvflow.distributed.parallel_state import ParallelState
from kvflow.sampling.sampler import greedy


class StageRunner:
    def __init__(self, model: nn.Module, kv_caches: list, state: ParallelState, full_config: ModelConfig,
                 dtype: torch.dtype, fused=None) -> None:
        """`fused`: the stage's `FusedLlamaStack` (tensor_parallel_size 1 only), or None for the modules."""
        self.model, self.kv_caches, self.state, self.fused = model, kv_caches, state, fused
        self.vocab_size, self.hidden_size, self.dtype = full_config.vocab_size, full_config.hidden_size, dtype

    @torch.inference_mode()
    def execute(self, msg: StepMessage) -> StepResult | None:
        """Run the step; the result on the output rank, None on every other rank."""
        state, model = self.state, self.model
        meta = msg.attn_metadata()
        positions = torch.from_numpy(msg.positions)
        if state.is_first_stage:
            x = vocab_parallel_embedding(model.embed_tokens.weight, torch.from_numpy(msg.input_ids),
                                         self.vocab_size, state)
            residual = None
        else:
            both = torch.empty(2, msg.num_tokens, self.hidden_size, dtype=self.dtype)
            dist.recv(both, src=state.prev_rank)
            x, residual = both[0], both[1]
        fused_out = None
        if self.fused is not None:  # the first stage's embeddings are its residual stream
            stream = x if residual is None else residual
            fused_out = self.fused.run_stage(stream, None if residual is None else x, positions, self.kv_caches, meta)
        if fused_out is not None:
            x, residual = fused_out, stream  # on the last stage x is then the final normed hidden state
        else:
            for layer, kv_cache in zip(model.layers, self.kv_caches):
                x, residual = layer(positions, x, residual, kv_cache, meta)
        if not state.is_last_stage:
            dist.send(torch.stack([x, residual]), dst=state.next_rank)
            return None
        if msg.logits_indices.shape[0] == 0:
            return StepResult(token_ids=[]) if state.tp_rank == 0 else None
        hidden = (x if fused_out is not None else model.norm(x, residual)[0])[torch.from_numpy(msg.logits_indices)]
        logits = vocab_parallel_logits(model.lm_head, hidden, self.vocab_size, state)
        if logits is None:
            return None
        if msg.argmax_only:
            return StepResult(token_ids=greedy(logits).tolist())
        return StepResult(logits=logits)
