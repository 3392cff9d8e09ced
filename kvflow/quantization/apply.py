"""Quantizing a loaded model's linear layers at load time (int8, int4).

Runs after the weights are loaded and before they are packed: each `Linear` but the LM head
(unless `quantize_lm_head`) and a mixture of experts' routers trades its float weight for a
`QuantizedWeight`. Layers a GGUF file or a compressed-tensors or GPTQ checkpoint shipped
quantized already hold theirs and are left as they are.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch import nn

from kvflow.layers.linear import Linear
from kvflow.layers.memory import return_freed_heap
from kvflow.layers.moe import ROUTER_NAMES
from kvflow.quantization.config import SHIPPED, QuantizationConfig
from kvflow.quantization.methods import quantize

logger = logging.getLogger("kvflow")


def quantize_model(model: nn.Module, config: QuantizationConfig) -> Counter:
    """Quantize every eligible `Linear`; returns how many layers run on each format."""
    if config.method in SHIPPED:
        for name, module in model.named_modules():
            if isinstance(module, Linear) and module.quant_weight is None and _eligible(name, config):
                logger.info("quantization=%s: %s was not quantized in the checkpoint; it runs in %s",
                            config.method, name, module.weight.dtype)
    else:
        for module in quantizable_linears(model, config).values():
            module.set_quantized(quantize(module.weight.detach(), config.method, config.group_size))
    return_freed_heap()
    return summarize(model)


def quantizable_linears(model: nn.Module, config: QuantizationConfig) -> dict[str, Linear]:
    """The float `Linear`s that `config` (int8, int4) quantizes at load, by module name.

    Each is checked against the config first, so a group size that does not divide some layer's
    input is refused before any weight is quantized."""
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, Linear) and m.quant_weight is None and _eligible(name, config)}
    for name, module in linears.items():
        config.check_layer(name, module.in_features)
    return linears


def summarize(model: nn.Module) -> Counter:
    """Layers per weight format, e.g. {"gguf:Q4_1": 210, "torch.bfloat16": 1}."""
    return Counter(m.quant_weight.source if m.quant_weight is not None else str(m.weight.dtype)
                   for m in model.modules() if isinstance(m, Linear))


def _eligible(name: str, config: QuantizationConfig) -> bool:
    """Every linear layer but a mixture of experts' routers (a handful of weights whose rounding
    would move tokens between experts) and, unless asked, the LM head."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf not in ROUTER_NAMES and (config.quantize_lm_head or leaf != "lm_head")
