"""The gated activation of Llama-family MLPs: silu(gate) * up over a fused gate/up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers import cpu_kernels


class SiluAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]. One fused pass on the CPU (kvflow's kernel), else three ops."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.is_cuda:
            from kvflow.layers.triton import elementwise  # the CUDA path only: triton is imported there

            if elementwise.enabled():
                return elementwise.silu_and_mul(gate_up)
        kernels = cpu_kernels.for_tensors(gate_up)
        if kernels is not None:
            return kernels.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
