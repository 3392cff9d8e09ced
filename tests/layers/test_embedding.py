"""The tied embedding read from its packed LM head (kvflow/layers/embedding.py): the same rows as
the table it replaces, in every layout it reads, and the table kept where it cannot read one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvflow.layers import cpu_kernels
from kvflow.layers.embedding import TiedHeadEmbedding, packed_rows, tie_embedding_to_head
from kvflow.layers.linear import Linear, pack_linear_weights
from kvflow.quantization import methods, tiles

VOCAB, HIDDEN = 83, 64  # a vocabulary that is not whole tiles of 16: the last tile is padded


@pytest.fixture(autouse=True)
def _packing_enabled(monkeypatch):
    monkeypatch.delenv("KVFLOW_PACKED_LINEAR", raising=False)


class TiedModel(nn.Module):
    """The two modules `tie_embedding_to_head` looks at, as the Llama model holds them."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = type("Config", (), {"tie_word_embeddings": True})()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN).to(dtype)
        self.lm_head = Linear(HIDDEN, VOCAB, bias=False).to(dtype)
        self.lm_head.weight = self.embed_tokens.weight


def kvflow_gemm(dtype: torch.dtype) -> bool:
    kernels = cpu_kernels.load()
    return kernels is not None and kernels.has_gemm(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tied_embedding_reads_the_packed_head(dtype):
    if not kvflow_gemm(dtype):
        pytest.skip("kvflow's GEMM does not run here (no kernels, or no AVX2 + FMA): the head is not in its tiles")
    model = TiedModel(dtype)
    table = model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([[0, 15, 16, 82], [81, 40, 3, 3]])
    hidden = torch.randn(5, HIDDEN).to(dtype)
    with torch.no_grad():
        pack_linear_weights(model)
        logits = model.lm_head(hidden)
        assert tie_embedding_to_head(model)
        assert isinstance(model.embed_tokens, TiedHeadEmbedding)
        assert model.embed_tokens.weight.device.type == "meta" and model.lm_head.weight.device.type == "meta"
        assert model.embed_tokens.weight.dtype == dtype and model.embed_tokens.weight.shape == (VOCAB, HIDDEN)
        assert torch.equal(model.embed_tokens(ids), table[ids])
        assert torch.equal(model.embed_tokens(torch.arange(VOCAB)), table)
        assert torch.equal(model.embed_tokens(ids.to(torch.int32)), table[ids])
        with pytest.raises(TypeError, match="int64 or int32"):
            model.embed_tokens(ids.float())
        assert torch.equal(model.lm_head(hidden), logits)  # the head itself is untouched
        for bad in (VOCAB, VOCAB + 5, -1):  # VOCAB + 5 lies in the last tile's padding
            with pytest.raises(IndexError, match="out of range"):
                model.embed_tokens(torch.tensor([1, bad]))


@pytest.mark.parametrize("kind", ["float32-scales", "float16-scales", "offsets"])
def test_rows_from_8_bit_tiles_are_the_dequantized_table(kind):
    """GGUF's tied Q8_0 head: the rows come from its blocks, dequantized as the loader dequantizes
    the table (q * scale, then + offset, in float32; one rounding to bf16)."""
    if not tiles.available():
        pytest.skip("the quantized tiles do not run here (no AVX512-BF16 or AVX2 + FMA)")
    torch.manual_seed(1)
    w = torch.randn(VOCAB, HIDDEN) * 0.05
    if kind == "offsets":  # int8 values with a scale and an offset per group
        weight = methods.quantize_int4(w, 32).widened(32)
        assert weight.offsets is not None and bool(weight.offsets.any())
    else:
        weight = methods.quantize_int8(w, group_size=32)
    if kind == "float16-scales":
        weight.scales = weight.scales.half().float()  # float16 values: PAIRS_HALF where the vector kernels run
    head = Linear(HIDDEN, VOCAB, bias=False).to(torch.bfloat16)
    head.set_quantized(weight)
    head.pack()
    assert head.quant_tiles is not None and head.quant_tiles.layout in (tiles.PAIRS, tiles.PAIRS_HALF)
    rows = packed_rows(head, torch.bfloat16)
    assert rows is not None
    table = weight.dequantize(torch.float32).to(torch.bfloat16)
    ids = torch.tensor([0, 17, 82, 16, 0])
    assert torch.equal(rows(ids), table[ids])


def test_the_table_stays_where_the_head_is_not_readable(monkeypatch):
    """A plain head (KVFLOW_PACKED_LINEAR=0), or an untied one, leaves the embedding alone."""
    monkeypatch.setenv("KVFLOW_PACKED_LINEAR", "0")
    model = TiedModel(torch.bfloat16)
    pack_linear_weights(model)
    assert not tie_embedding_to_head(model)
    assert isinstance(model.embed_tokens, nn.Embedding) and model.embed_tokens.weight.device.type == "cpu"
    monkeypatch.delenv("KVFLOW_PACKED_LINEAR")
    untied = TiedModel(torch.bfloat16)
    untied.config.tie_word_embeddings = False
    pack_linear_weights(untied)
    assert not tie_embedding_to_head(untied)
    assert isinstance(untied.embed_tokens, nn.Embedding)


def test_rows_that_differ_keep_the_table():
    """The check at load compares every row: a head that is not the table leaves it in place."""
    if not kvflow_gemm(torch.bfloat16):
        pytest.skip("kvflow's bf16 GEMM does not run here: the head is not in its tiles")
    model = TiedModel(torch.bfloat16)
    model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone(), requires_grad=False)
    with torch.no_grad():
        model.lm_head.weight[70, 5] += 1
    pack_linear_weights(model)
    assert not tie_embedding_to_head(model)
    assert isinstance(model.embed_tokens, nn.Embedding) and model.embed_tokens.weight.device.type == "cpu"
