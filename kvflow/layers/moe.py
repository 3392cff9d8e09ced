"""A sparse mixture-of-experts MLP: each token runs through the top-k of E expert MLPs.

Mixtral, Qwen2-MoE and Qwen3-MoE share this block and differ in switches:
  - the router (`gate`, a [E, hidden] projection) gives each token E logits; a float32 softmax
    over them, the k largest probabilities pick the experts, and those k weights are
    renormalised to sum to one where the model says so (`norm_topk_prob`: Mixtral always,
    Qwen per config);
  - Mixtral scales an expert's output by its float32 weight; the Qwen MoEs round the weights
    to the model's dtype first (`round_weights`), as transformers does;
  - Qwen2-MoE adds an always-on shared expert scaled by sigmoid(shared_expert_gate(x)).

Once the weights are packed for kvflow's GEMM, the whole block is one C++ call
(csrc/moe.cpp, which the fused decoder stack calls too): routing, each chosen expert's GEMMs on
its rows, the weighting and each token's sum; at a batch-1 decode step of a 32-expert model
3.6x faster than the same block in PyTorch ops (scripts/moe_block_cost.py). `forward_torch` is
that PyTorch path, for everything else (no kernels, float16, CUDA, KVFLOW_MOE_KERNEL=0): it
gathers the step's (token, expert) pairs grouped by expert once, runs each chosen expert on its
contiguous rows, weights all outputs in one op, and adds each token's outputs in expert order,
as the reference does, with element-wise adds. In both, a token's result depends only on the
token: the same alone, batched, chunked or recomputed after a preemption (the GEMMs are
batch-invariant, the rest is per token); the two differ in rounding only (the softmax's exp and
sums, the sigmoid), so a deployment keeps to one of them. The expert
set is read on the host, so a CUDA graph cannot capture this block (model_placement.py runs it
eagerly).
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from kvflow.layers import cpu_kernels
from kvflow.layers.kernel_structs import MoE, QuantLinear, linear_pointers, runs_in_stack
from kvflow.layers.linear import Linear
from kvflow.layers.mlp import GatedMLP

# The routers' module names: they stay in the model's dtype under weight quantization.
ROUTER_NAMES = frozenset({"gate", "shared_expert_gate"})


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *,
                 norm_topk_prob: bool, round_weights: bool, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the model's {num_experts} experts")
        self.num_experts, self.top_k = num_experts, top_k
        self.norm_topk_prob, self.round_weights = norm_topk_prob, round_weights
        self.gate = Linear(hidden_size, num_experts, bias=False)  # the router; never quantized
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        self._record: MoE | None = None  # csrc/moe.cpp's view of the packed weights (kernel_record)
        self._record_tried = False
        self.kernel_dtype: torch.dtype | None = None  # the activations' dtype kernel_record was built for
        self._keep: list = []

    def kernel_record(self) -> MoE | None:
        """The block as csrc/moe.cpp reads it, once the weights are packed for kvflow's GEMM in one
        dtype (experts may be quantized tiles in bf16); None where they are not (the PyTorch path
        runs). Built on first use: packing happens at load, before any forward."""
        if self._record_tried:
            return self._record
        self._record_tried = True
        kernels = cpu_kernels.load()
        dtype = self.gate.weight.dtype
        experts = [(e.gate_up_proj, e.down_proj) for e in self.experts]
        shared = self.shared_expert
        linears = [*(m for pair in experts for m in pair), *(
            (shared.gate_up_proj, shared.down_proj) if shared is not None else ())]
        routers = [self.gate, *((self.shared_expert_gate,) if shared is not None else ())]
        if (kernels is None or os.environ.get("KVFLOW_MOE_KERNEL", "1") == "0" or not kernels.has_gemm(dtype)
                or not all(runs_in_stack(m, dtype) for m in linears)  # experts: packed, or quantized tiles
                or not all(r.packing == "kvflow" and r.packed_weight.dtype == dtype for r in routers)):
            return None
        keep = self._keep
        gate_up = [linear_pointers(g, keep) for g, _ in experts]
        down = [linear_pointers(d, keep) for _, d in experts]
        pointers = ctypes.c_void_p * len(experts)
        records = ctypes.POINTER(QuantLinear) * len(experts)
        arrays = [pointers(*(w for w, _ in gate_up)), pointers(*(w for w, _ in down)),
                  records(*(q for _, q in gate_up)), records(*(q for _, q in down))]
        keep += arrays
        record = MoE(num_experts=self.num_experts, top_k=self.top_k, intermediate=self.experts[0].intermediate_size,
                     norm_topk_prob=int(self.norm_topk_prob), round_weights=int(self.round_weights),
                     router=linear_pointers(self.gate, keep)[0], gate_up=arrays[0], down=arrays[1],
                     gate_up_q=arrays[2], down_q=arrays[3])
        if shared is not None:
            record.shared_intermediate = shared.intermediate_size
            record.shared_gate_up, record.shared_gate_up_q = linear_pointers(shared.gate_up_proj, keep)
            record.shared_down, record.shared_down_q = linear_pointers(shared.down_proj, keep)
            record.shared_gate = linear_pointers(self.shared_expert_gate, keep)[0]
        fn = kernels.lib.kvflow_moe_forward
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(MoE), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._record, self._fn, self.kernel_dtype = record, fn, dtype
        return record

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), both [tokens, top_k]: each token's chosen experts, by probability."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        record = self.kernel_record() if x.is_cpu else None
        if record is not None and x.dtype == self.kernel_dtype and x.dim() == 2 and x.is_contiguous():
            out = torch.empty_like(x)
            cpu_kernels.check_rc(self._fn(cpu_kernels.DTYPE_CODES[x.dtype], ctypes.byref(record), x.data_ptr(),
                                          x.shape[0], x.shape[1], out.data_ptr()), "moe_forward")
            return out
        return self.forward_torch(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The block in PyTorch ops: where csrc/moe.cpp does not run (no kernels, float16, CUDA)."""
        weights, experts = self.route(x)
        # Each token's experts in ascending order: the order the reference adds their outputs in.
        experts, order = experts.sort(dim=-1)
        weights = weights.gather(1, order)
        # (token, slot) pairs grouped by expert: each expert's rows are one contiguous run
        flat = experts.flatten()
        pairs = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, pairs // self.top_k)
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                outputs.append(self.experts[expert](rows[start: start + count]))
                start += count
        y = (torch.cat(outputs) * weights.flatten().index_select(0, pairs).unsqueeze(1)).to(x.dtype)
        # Back to (token, slot) places, then each token's k outputs summed in slot order: plain
        # element-wise adds, so a token's sum never depends on the other tokens of the step.
        per_slot = torch.empty(flat.numel(), x.shape[1], dtype=x.dtype, device=x.device).index_copy_(0, pairs, y)
        per_slot = per_slot.view(-1, self.top_k, x.shape[1])
        out = per_slot[:, 0].clone() if self.top_k == 1 else per_slot[:, 0] + per_slot[:, 1]
        for slot in range(2, self.top_k):
            out = out + per_slot[:, slot]
        if self.shared_expert is not None:
            out = out + vector_sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# Elements per call of `vector_sigmoid`: a multiple of every vector loop's stride (AVX-512 bf16:
# 64), and below PyTorch's grain size (32,768), so one thread runs the call from its first element.
_SIGMOID_SLICE = 16384


def vector_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid with the same bits for an element wherever it sits in the tensor.

    PyTorch's CPU sigmoid runs a vector loop and finishes the last few elements with the scalar
    formula, whose exp rounds differently; a token's shared-expert gate (one value per token)
    would then change with the number of tokens in the step. Padded to whole slices of
    `_SIGMOID_SLICE`, every element takes the vector loop."""
    if x.device.type != "cpu":
        return torch.sigmoid(x)
    flat = x.reshape(-1)
    padded = torch.zeros(-(-flat.numel() // 64) * 64, dtype=x.dtype)
    padded[: flat.numel()] = flat
    for piece in padded.split(_SIGMOID_SLICE):
        piece.sigmoid_()
    return padded[: flat.numel()].view(x.shape)
