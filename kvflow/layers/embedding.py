"""The token embedding of a tied LM head, read from the head's packed weight.

A model whose LM head is its embedding table (`tie_word_embeddings`: SmolLM2, Llama 3.2,
Qwen2.5's small models) holds that [vocab, hidden] table twice once its linears are packed:
as the table the lookup indexes, and as the head's GEMM tiles. A step looks up one row per
token, so the rows can come from the tiles instead and the table be released: 54 MiB of
SmolLM2's resident memory in bf16, and as much with its GGUF file run as shipped (the head on
the embedding's own Q8_0 blocks).

The rows are the table's bits: kvflow's bf16 and float32 layouts are permutations of the weight,
and 8-bit tiles dequantize as the table was dequantized at load (the integer times its float
scale, exact in float32, plus the offset, then one rounding to the model's dtype).
`tie_embedding_to_head` checks every row against the table before releasing it and leaves the
table in place for any layout it cannot read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from kvflow.layers import cpu_kernels
from kvflow.layers.linear import Linear
from kvflow.layers.memory import return_freed_heap
from kvflow.quantization import tiles as tile_kernels

logger = logging.getLogger(__name__)

RowsOf = Callable[[torch.Tensor], torch.Tensor]  # token ids [n] -> their embeddings [n, hidden]
_CHECK_ROWS = 4096  # rows compared at a time at load: the check's own memory stays small


class TiedHeadEmbedding(nn.Module):
    """`nn.Embedding`'s forward on rows gathered from a tied head's packed weight. `weight` is a
    meta tensor: its shape and dtype stay visible, its data lives in the head."""

    def __init__(self, rows_of: RowsOf, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rows_of, self.num_embeddings, self.embedding_dim = rows_of, num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype, device="meta"),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dtype not in (torch.int64, torch.int32):  # as nn.Embedding takes them
            raise TypeError(f"token ids must be int64 or int32, got {input_ids.dtype}")
        # (an id outside the vocabulary, the padding of the head's last tile included, is an
        # IndexError from the gather, as nn.Embedding raises one)
        return self.rows_of(input_ids.reshape(-1)).view(*input_ids.shape, self.embedding_dim)


def packed_rows(head: Linear, dtype: torch.dtype) -> RowsOf | None:
    """How to gather embedding rows (in `dtype`) from `head`'s packed weight, or None for a
    layout that is not read here (oneDNN's, 4-bit tiles, a plain weight, no CPU kernels)."""
    kernels = cpu_kernels.load()
    if kernels is None:
        return None
    k, n, cols = head.in_features, head.out_features, tile_kernels.TILE_COLS
    packed = head.packed_weight
    if head.packing == "kvflow" and packed is not None:  # 4-byte cells: a bf16 pair, or one float32
        cells = k // 2 if packed.dtype == torch.bfloat16 else k
        return lambda ids: kernels.gather_packed_rows(packed, n, cells, torch.int32, ids).view(packed.dtype)
    t = head.quant_tiles
    if t is None or t.bits != 8 or t.layout not in (tile_kernels.PAIRS, tile_kernels.PAIRS_HALF):
        return None
    group = t.group_size

    def rows(ids: torch.Tensor) -> torch.Tensor:  # a k pair's two int8 quants per cell
        quants = kernels.gather_packed_rows(t.q, n, k // 2, torch.int16, ids).view(torch.int8)
        tile, col = ids // cols, ids % cols
        w = quants.float() * t.scales[tile, :, col].float().repeat_interleave(group, dim=1)
        if t.offsets is not None:
            w = w + t.offsets[tile, :, col].float().repeat_interleave(group, dim=1)
        return w.to(dtype)
    return rows


def tie_embedding_to_head(model: nn.Module) -> bool:
    """Where `model.lm_head` is tied to `model.embed_tokens` and packed in a layout
    `packed_rows` reads, whose rows equal the table's: the embedding reads the head and the table
    is released. Returns whether it was."""
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if not isinstance(embed, nn.Embedding) or not isinstance(head, Linear):
        return False
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False) or embed.weight.device.type != "cpu":
        return False
    table = embed.weight.detach()
    rows_of = packed_rows(head, table.dtype)
    if rows_of is None:
        return False
    vocab, hidden = table.shape
    with torch.inference_mode():
        for start in range(0, vocab, _CHECK_ROWS):
            ids = torch.arange(start, min(vocab, start + _CHECK_ROWS))
            if not torch.equal(rows_of(ids), table[start:start + ids.numel()]):
                logger.info("the tied LM head's packed rows differ from the embedding table (row %d on): the "
                            "table stays", start)
                return False
    if head.weight is embed.weight:  # bf16/float32: the head's plain weight was kept for the lookup
        head.release_plain_weight()
    model.embed_tokens = TiedHeadEmbedding(rows_of, vocab, hidden, table.dtype)
    del table, embed
    return_freed_heap()
    return True
