"""`LoRALinear`: a base projection plus, for the rows that ask, an adapter's low-rank delta.

The manager replaces each adapted projection of the model (`qkv_proj`, `o_proj`,
`gate_up_proj`, `down_proj`) with one of these. The base projection runs on the whole batch
as before; then each adapter in the step adds `B(A(x))` to its own rows only. Rows are grouped
per adapter (`LoRAStep`), so a step costs two small GEMMs per adapter and projection, not one
per sequence. A and B are `Linear`s packed like any other weight: kvflow's GEMM sums in an
order that does not depend on the number of rows, so a token's delta is the same alone or
batched, as the base projection's is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvflow.layers.linear import Linear


@dataclass
class LoRAStep:
    """Which rows of the current step run which adapter, shared by every `LoRALinear` of a model.
    A group's rows are a slice when they are contiguous (one prefill, or a run of decodes),
    else an index tensor. No groups: the step is the base model's alone."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


class LoRALinear(nn.Module):
    def __init__(self, base: Linear, step: LoRAStep) -> None:
        super().__init__()
        self.base = base
        self.step = step
        # lora_int_id -> (A: Linear in -> R, B: Linear R -> out). A plain dict, not submodules: the
        # model's parameters stay the base model's (loading, packing and memory plans see those).
        self.adapters: dict[int, tuple[Linear, Linear]] = {}

    def add_adapter(self, lora_int_id: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Hold an adapter's A [R, in] and B [out, R] (B scaled), in the base weight's dtype and packed."""
        dtype, device = self.base.weight.dtype, self.base.weight.device
        if device.type == "meta":  # the base runs on its packed weight; its dtype is the plain one's
            device = torch.device("cpu") if self.base.packed_weight is None else self.base.packed_weight.device
        pair = []
        for weight in (a, b):
            linear = Linear(weight.shape[1], weight.shape[0], bias=False, device=device, dtype=dtype)
            with torch.no_grad():
                linear.weight.copy_(weight)
            linear.requires_grad_(False)
            linear.pack()
            pair.append(linear)
        self.adapters[lora_int_id] = (pair[0], pair[1])

    def remove_adapter(self, lora_int_id: int) -> None:
        self.adapters.pop(lora_int_id, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for lora_int_id, rows in self.step.groups:
            pair = self.adapters.get(lora_int_id)
            if pair is None:  # this adapter leaves this projection as it is
                continue
            a, b = pair
            if isinstance(rows, slice):
                y[rows] += b(a(x[rows]))
            else:
                y.index_add_(0, rows, b(a(x.index_select(0, rows))))
        return y
