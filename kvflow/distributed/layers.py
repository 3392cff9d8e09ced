"""What each rank holds of each weight, and the collectives inside a layer.

Megatron's split of a Llama layer, one all-reduce per sublayer:
  - column-parallel: the fused QKV rows of the rank's heads (and their biases), the fused
    gate/up rows of its MLP slice; each rank computes its heads' attention on its own;
  - row-parallel: the o_proj and down_proj columns of the same slices; each rank's product is
    a partial sum, and one all-reduce (`RowParallel`) makes the full output on every rank;
  - a mixture of experts: every expert split like the dense MLP, the routers replicated, and one
    all-reduce after the block's weighted sum;
  - vocab-parallel: embedding rows and LM-head rows of a vocabulary slice. A token's row is on
    one rank; the others contribute zeros, so the all-reduce of the embedding is exact. The LM
    head's logit shards are gathered on TP rank 0 and cut back to the vocabulary.
Norms are replicated. The model code builds a rank's share as an ordinary, smaller model
(`ParallelConfig.rank_model_config`): `shard_weights` renames and slices the checkpoint's
tensors on their way in, so `models/` needs no knowledge of ranks.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.config import ModelConfig
from kvflow.distributed.config import ParallelConfig
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.moe import SparseMoeBlock
from kvflow.models.llama import family_name
from kvflow.quantization.qweight import QuantizedWeight

_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
Weight = torch.Tensor | QuantizedWeight


def shard_weights(weights: Iterable[tuple[str, Weight]], cfg: ModelConfig, parallel: ParallelConfig, rank: int
                  ) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's HF-named tensors as rank `rank` holds them: its layers renumbered from 0,
    its slices of the split tensors, nothing of the layers and ends it does not hold."""
    tp_rank, stage = parallel.rank_coords(rank)
    start, end = parallel.layer_range(cfg.num_hidden_layers, stage)
    first, last = parallel.is_first_stage(rank), parallel.is_last_stage(rank)
    t = parallel.tensor_parallel_size
    for hf_name, tensor in weights:
        name = family_name(hf_name).removeprefix("model.")  # (Mixtral's experts as gate/up/down_proj)
        match = _LAYER.match(name)
        if match is not None:
            index = int(match.group(1))
            if not start <= index < end:
                continue
            name = f"layers.{index - start}.{match.group(2)}"
        elif name.startswith("embed_tokens."):
            if not (first or (last and cfg.tie_word_embeddings)):
                continue
        elif name.startswith(("norm.", "lm_head.")):
            if not last:
                continue
        if t > 1:
            if isinstance(tensor, QuantizedWeight):
                raise ValueError(f"tensor_parallel_size={t}: {hf_name} arrives quantized, and quantized weights "
                                 "are not split across ranks yet; pass dtype='float32' or 'bfloat16' (or "
                                 "quantization='none')")
            tensor = _slice(name, tensor, cfg, parallel, tp_rank)
        yield name, tensor


def _mlp_width(name: str, cfg: ModelConfig) -> int:
    """The intermediate size of the MLP a gate/up/down tensor belongs to: an expert's, the
    shared expert's or the dense MLP's."""
    if ".experts." in name:
        return cfg.moe_intermediate_size
    if ".shared_expert." in name:
        return cfg.shared_expert_intermediate_size
    return cfg.intermediate_size


def _slice(name: str, tensor: torch.Tensor, cfg: ModelConfig, parallel: ParallelConfig, tp_rank: int) -> torch.Tensor:
    t, d = parallel.tensor_parallel_size, cfg.head_dim
    if ".q_proj." in name:
        heads = cfg.num_attention_heads // t
        return tensor.narrow(0, tp_rank * heads * d, heads * d)
    if ".k_proj." in name or ".v_proj." in name:
        first, count = parallel.kv_heads(cfg, tp_rank)
        return tensor.narrow(0, first * d, count * d)
    if ".o_proj." in name:
        heads = cfg.num_attention_heads // t
        return tensor.narrow(1, tp_rank * heads * d, heads * d)
    if ".gate_proj." in name or ".up_proj." in name:
        size = _mlp_width(name, cfg) // t
        return tensor.narrow(0, tp_rank * size, size)
    if ".down_proj." in name:
        size = _mlp_width(name, cfg) // t
        return tensor.narrow(1, tp_rank * size, size)
    if name.startswith(("embed_tokens.", "lm_head.")):
        start, held, padded = parallel.vocab_shard(cfg.vocab_size, tp_rank)
        rows = tensor.narrow(0, start, held) if held else tensor[:0]
        if held < padded:  # the last shard's padding rows: zero embeddings, logits cut off after the gather
            rows = torch.cat([rows, rows.new_zeros(padded - held, *rows.shape[1:])])
        return rows
    return tensor  # norms: replicated


class RowParallel(nn.Module):
    """A row-parallel projection: the rank's partial product, then one all-reduce."""

    def __init__(self, linear: nn.Module, state: ParallelState) -> None:
        super().__init__()
        self.linear, self.state = linear, state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.state.all_reduce(self.linear(x).contiguous())


def make_row_parallel(model: nn.Module, state: ParallelState) -> None:
    """Wrap every layer's o_proj and down_proj (after loading, so parameter names stay HF-shaped)."""
    if state.config.tensor_parallel_size == 1:
        return
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, state)
        if isinstance(layer.mlp, SparseMoeBlock):
            # Every expert's output is a partial sum, and so is their weighted sum (the routers are
            # replicated, so every rank routes a token alike): one all-reduce for the whole block.
            layer.mlp = RowParallel(layer.mlp, state)
        else:
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, state)


def vocab_parallel_embedding(weight: torch.Tensor, input_ids: torch.Tensor, vocab_size: int,
                             state: ParallelState) -> torch.Tensor:
    """Rows of the rank's vocabulary slice, zeros for the others, summed over the group."""
    if state.config.tensor_parallel_size == 1:
        return F.embedding(input_ids, weight)
    start, held, _ = state.config.vocab_shard(vocab_size, state.tp_rank)
    local = input_ids - start
    outside = (local < 0) | (local >= held)
    x = F.embedding(local.clamp(0, max(held - 1, 0)), weight)
    x[outside] = 0
    return state.all_reduce(x)


def vocab_parallel_logits(lm_head: nn.Module, hidden: torch.Tensor, vocab_size: int,
                          state: ParallelState) -> torch.Tensor | None:
    """float32 logits of `hidden`'s rows over the whole vocabulary on TP rank 0, None elsewhere."""
    local = lm_head.forward_float32(hidden)
    full = state.gather_to_first(local)
    return None if full is None else full[:, :vocab_size]
