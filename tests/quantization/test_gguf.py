"""GGUF blocks run as shipped: bit for bit gguf's own dequantization, on real files' tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvflow.quantization.gguf import from_gguf_blocks


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_dequantize_bit_for_bit_like_gguf(kind):
    qtype = GGMLQuantizationType[kind]
    w = np.random.default_rng(0).standard_normal((48, 128)).astype(np.float32)
    raw = quantize(w, qtype)
    qw = from_gguf_blocks(raw, qtype.value, (48, 128))
    assert qw.source == f"gguf:{kind}" and qw.group_size == 32
    assert torch.equal(qw.dequantize(), torch.from_numpy(dequantize(raw, qtype).reshape(48, 128)))


def test_default_models_q4_1_tensor(smollm2_gguf):
    from kvflow.loader.gguf_loader import _header

    info = next(t for t in _header(smollm2_gguf).tensors if t.name == "blk.0.ffn_down.weight")
    assert GGMLQuantizationType(info.qtype).name == "Q4_1"
    data = np.memmap(smollm2_gguf, dtype=np.uint8, mode="r")[info.offset : info.offset + info.nbytes]
    qw = from_gguf_blocks(np.asarray(data), info.qtype, info.shape)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_1]
    ref = dequantize(np.asarray(data).reshape(info.shape[0], -1), GGMLQuantizationType.Q4_1)
    assert torch.equal(qw.dequantize(), torch.from_numpy(ref.reshape(info.shape)))
    assert qw.nbytes < info.shape[0] * info.shape[1]  # 4 bits + scales: under a byte per weight


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_into_gives_the_dequantized_weight_in_any_chunks(kind, dtype):
    """A tied GGUF head's table is dequantized into the model a few thousand rows at a time
    (no float32 copy of the whole table): the same values as one dequantization, rounded once."""
    qtype = GGMLQuantizationType[kind]
    raw = quantize(np.random.default_rng(1).standard_normal((48, 128)).astype(np.float32), qtype)
    qw = from_gguf_blocks(raw, qtype.value, (48, 128))
    for rows_at_a_time in (7, 48, 4096):
        out = torch.full((48, 128), float("nan"), dtype=dtype)
        qw.dequantize_into(out, rows_at_a_time)
        assert torch.equal(out, qw.dequantize().to(dtype))
    with pytest.raises(ValueError, match="shape"):
        qw.dequantize_into(torch.empty(47, 128))


def test_tied_gguf_table_comes_as_the_heads_blocks(smollm2_gguf):
    """With the head run on the embedding's own blocks, the loader hands the table over as those
    blocks (the model dequantizes them), not as a float32 copy of the whole table."""
    from kvflow.loader import _runs_as_shipped
    from kvflow.loader.gguf_loader import _header, iter_gguf_weights

    got = {}
    for name, weight in iter_gguf_weights(smollm2_gguf, keep_quantized=_runs_as_shipped):
        if name in ("lm_head.weight", "model.embed_tokens.weight"):
            got[name] = weight
        if len(got) == 2:
            break
    blocks = got["model.embed_tokens.weight"]
    assert blocks is got["lm_head.weight"] and blocks.source == "gguf:Q8_0"
    # What the model makes of them: gguf's own dequantization, rounded once to the model's dtype.
    info = next(t for t in _header(smollm2_gguf).tensors if t.name == "token_embd.weight")
    data = np.memmap(smollm2_gguf, dtype=np.uint8, mode="r")[info.offset : info.offset + info.nbytes]
    ref = torch.from_numpy(dequantize(np.asarray(data).reshape(info.shape[0], -1), GGMLQuantizationType.Q8_0))
    for dtype in (torch.float32, torch.bfloat16):
        table = torch.empty(blocks.shape, dtype=dtype)
        blocks.dequantize_into(table)
        assert torch.equal(table, ref.to(dtype))
