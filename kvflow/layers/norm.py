"""RMSNorm, computed in float32 whatever the activation dtype (as the reference does).

With a `residual`, the norm first adds the sublayer output into the residual stream
(`residual += x`, rounded to the activation dtype as the reference's `residual + x` is) and
normalises the sum: one fused pass in kvflow's CPU kernel instead of seven PyTorch ops.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.layers import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given a residual, (norm(residual + x), residual + x)."""
        if x.is_cuda:
            from kvflow.layers.triton import elementwise  # the CUDA path only: triton is imported there

            if elementwise.enabled():
                return elementwise.add_rms_norm(x, residual, self.weight, self.eps)  # residual updated in place
        operands = (x, self.weight) if residual is None else (x, residual, self.weight)
        kernels = cpu_kernels.for_tensors(*operands)
        if kernels is not None:
            out = kernels.add_rms_norm(x, residual, self.weight, self.eps)  # residual updated in place
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(dtype)
