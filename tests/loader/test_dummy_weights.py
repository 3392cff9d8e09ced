"""Dummy weights (`load_format="dummy"`) under int8/int4: each linear weight is quantized as it is
drawn, so a large shape's float model is never resident at once, and the result is the same
model as quantizing the whole float model after drawing it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvflow.loader as loader
from kvflow.config import ModelConfig
from kvflow.layers.attention import CPUAttentionBackend
from kvflow.layers.linear import Linear
from kvflow.quantization.apply import quantize_model
from kvflow.quantization.config import QuantizationConfig


def _load(path: str, quantization: QuantizationConfig | None):
    """The model as loaded, before packing (which moves weights into the kernels' layouts)."""
    cfg = ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    return loader.load_model(path, cfg, torch.float32, CPUAttentionBackend(), "dummy", seed=7,
                             quantization=quantization, fuse_stack=False)


def _linears(model) -> dict[str, Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("method,group_size", [("int8", None), ("int4", 32)])
def test_quantized_as_drawn_equals_quantized_after(tiny_models, monkeypatch, method, group_size):
    path, _ = tiny_models("llama")
    monkeypatch.setattr(loader, "pack_linear_weights", lambda model: None)
    config = QuantizationConfig.parse(method, group_size)
    events: list[str] = []
    draw, quantize = torch.Tensor.normal_, loader.quantize
    monkeypatch.setattr(torch.Tensor, "normal_", lambda t, *a, **k: events.append("draw") or draw(t, *a, **k))
    monkeypatch.setattr(loader, "quantize", lambda *a, **k: events.append("quantize") or quantize(*a, **k))
    as_drawn = _load(path, config)
    monkeypatch.setattr(torch.Tensor, "normal_", draw)

    # Interleaved: the first weight is quantized before the last is drawn (not all drawn first).
    assert "quantize" in events and events.index("quantize") < len(events) - 1 - events[::-1].index("draw")
    after = _load(path, None)
    quantize_model(after, config)
    mine, theirs = _linears(as_drawn), _linears(after)
    assert mine.keys() == theirs.keys()
    for name, module in mine.items():
        if name.endswith("lm_head"):  # kept in its dtype unless quantize_lm_head
            assert module.quant_weight is None and torch.equal(module.weight, theirs[name].weight)
            continue
        assert module.quant_weight is not None and module.weight.device.type == "meta", name
        assert module.quant_weight.source == method
        assert torch.equal(module.quant_weight.dequantize(), theirs[name].quant_weight.dequantize()), name


def test_dummy_group_that_does_not_divide_is_refused_before_drawing(tiny_models, monkeypatch):
    path, _ = tiny_models("llama")
    hidden = json.loads((Path(path) / "config.json").read_text())["hidden_size"]
    group = next(g for g in (32, 64, 96, 128, 160) if hidden % g)
    drawn: list[int] = []
    draw = torch.Tensor.normal_
    monkeypatch.setattr(torch.Tensor, "normal_", lambda t, *a, **k: drawn.append(1) or draw(t, *a, **k))
    with pytest.raises(ValueError, match="group"):
        _load(path, QuantizationConfig.parse("int4", group))
    assert not drawn
