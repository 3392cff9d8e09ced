"""`LoRAManager`: the adapters an engine serves, and which rows of each step run which.

It wraps the model's adapted projections once (`LoRALinear`), loads an adapter the first time
a request names it (checked against the base model then, so a bad adapter is the request's
error, not a failed step) and keeps up to `LoRAConfig.cache_size` adapters that no live
request uses (least recently used first out; adapters in use are never evicted). Before each
step the runner hands it the step's rows: `set_step` groups them per adapter for the layers.

Where the model runs as the fused C++ stack (models/llama_fused.py), an adapter whose A and B
took kvflow's GEMM layout runs inside it too: the stack adds each group's B(A(x)) after the base
GEMM, the same kernels in the same order as `LoRALinear`, so the result is the modules' bit for
bit (tests/lora/test_fused_lora.py). Other adapters' steps run the modules.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Iterable

import numpy as np
import torch
from torch import nn

from kvflow.config import ModelConfig
from kvflow.lora.adapter import LoRAAdapter, load_adapter
from kvflow.lora.layers import LoRALinear, LoRAStep
from kvflow.lora.request import LoRAConfig, LoRARequest
from kvflow.models.llama_fused import LoRAProjections

logger = logging.getLogger("kvflow")
_ADAPTED = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


class LoRAManager:
    def __init__(self, model: nn.Module, model_config: ModelConfig, config: LoRAConfig,
                 device: torch.device | str = "cpu") -> None:
        self.model, self.model_config, self.config = model, model_config, config
        self.device = torch.device(device)
        self.step = LoRAStep()
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        for i, layer in enumerate(model.layers):
            for block_name, proj in _ADAPTED:
                block = getattr(layer, block_name)
                wrapped = LoRALinear(getattr(block, proj), self.step)
                setattr(block, proj, wrapped)
                self.layers[(i, proj)] = wrapped
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.fused: dict[int, LoRAProjections] = {}  # adapters the fused C++ stack can run

    # ---- adapters ------------------------------------------------------------------------
    def add_adapter(self, request: LoRARequest, in_use: Iterable[int] = ()) -> LoRAAdapter:
        """Load `request`'s adapter unless it is loaded; ValueError naming what does not fit.
        `in_use`: ids live requests run with (never evicted to make room)."""
        loaded = self.adapters.get(request.lora_int_id)
        if loaded is not None:
            if loaded.request.lora_path != request.lora_path:
                raise ValueError(f"lora_int_id {request.lora_int_id} is loaded from {loaded.request.lora_path!r}; "
                                 f"{request.lora_path!r} needs an id of its own")
            self.adapters.move_to_end(request.lora_int_id)
            return loaded
        adapter = load_adapter(request, self.model_config, self.config.max_lora_rank)
        for key, (a, b) in adapter.weights.items():
            self.layers[key].add_adapter(request.lora_int_id, a, b)
        adapter.weights = {}  # the layers hold packed copies in the model's dtype; the float32 ones go
        self.adapters[request.lora_int_id] = adapter
        projections = self._fused_projections(request.lora_int_id)
        if projections is not None:
            self.fused[request.lora_int_id] = projections
        logger.info("LoRA adapter %r (id %d) loaded from %s: rank %d, %d projections, %.1f M parameters",
                    request.lora_name, request.lora_int_id, request.lora_path, adapter.rank, adapter.num_projections,
                    adapter.num_parameters / 1e6)
        self._evict(set(in_use) | {request.lora_int_id})
        return adapter

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Drop an adapter from memory; False if it was not loaded."""
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        self.fused.pop(lora_int_id, None)
        for layer in self.layers.values():
            layer.remove_adapter(lora_int_id)
        return True

    def _fused_projections(self, lora_int_id: int) -> LoRAProjections | None:
        """The adapter's packed A/B for the fused stack, or None when the model has no stack or
        one of its projections did not take kvflow's GEMM layout in the stack's dtype."""
        stack = getattr(self.model, "fused_stack", None)
        if stack is None:
            return None
        layers = []
        for i in range(len(self.model.layers)):
            entries = []
            for _, proj in _ADAPTED:
                pair = self.layers[(i, proj)].adapters.get(lora_int_id)
                if pair is None:
                    entries.append(None)
                    continue
                a, b = pair
                if not all(m.packing == "kvflow" and m.packed_weight.dtype == stack.dtype for m in pair):
                    return None
                entries.append((a.packed_weight, b.packed_weight, a.out_features))
            layers.append(entries)
        return LoRAProjections(layers)

    def _evict(self, keep: set[int]) -> None:
        for lora_int_id in list(self.adapters):
            if len(self.adapters) <= self.config.cache_size:
                return
            if lora_int_id not in keep:
                self.remove_adapter(lora_int_id)

    # ---- the step ------------------------------------------------------------------------
    def set_step(self, row_adapters: list[int], row_tokens: list[int]) -> bool:
        """Group the step's token rows by adapter: sequence i runs adapter `row_adapters[i]` (0: the
        base model) on its `row_tokens[i]` tokens, in the flat batch's order. Returns whether any row
        runs an adapter."""
        groups: list[tuple[int, slice | torch.Tensor]] = []
        fused: list[tuple[torch.Tensor, LoRAProjections]] = []
        if any(row_adapters):
            per_token = np.repeat(np.asarray(row_adapters, dtype=np.int64), row_tokens)
            for lora_int_id in np.unique(per_token[per_token > 0]).tolist():
                if lora_int_id not in self.adapters:
                    raise RuntimeError(f"LoRA adapter {lora_int_id} is scheduled but not loaded")
                rows = np.flatnonzero(per_token == lora_int_id)
                if rows[-1] - rows[0] + 1 == len(rows):
                    groups.append((lora_int_id, slice(int(rows[0]), int(rows[-1]) + 1)))
                else:
                    groups.append((lora_int_id, torch.from_numpy(rows).to(self.device)))
                if lora_int_id in self.fused:
                    fused.append((torch.from_numpy(rows), self.fused[lora_int_id]))
        self.step.groups = groups
        stack = getattr(self.model, "fused_stack", None)
        in_stack = len(fused) == len(groups)  # every adapter of the step runs in the C++ stack
        if stack is not None:
            stack.set_lora_step(fused if in_stack else [])
        self.model.use_fused_stack = in_stack
        return bool(groups)
