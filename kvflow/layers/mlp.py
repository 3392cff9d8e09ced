"""The gated SiLU MLP of the Llama family: down(silu(gate(x)) * up(x)).

Gate and up are one projection (`gate_up_proj`, output [gate | up]); a model's loader folds the
checkpoint's two tensors into it. A dense decoder layer holds one of these; a mixture of
experts (layers/moe.py) holds one per expert.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.layers.activation import SiluAndMul
from kvflow.layers.linear import Linear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))
