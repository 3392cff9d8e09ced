"""ctypes mirrors of the records the composed C++ kernels read (csrc/stack_gemm.h, csrc/moe.cpp),
and how a packed `Linear` fills them: shared by the MoE block (layers/moe.py) and the fused
decoder stack (models/llama_fused.py), which hand the same weights to C++."""

from __future__ import annotations

import ctypes

import torch

from kvflow.layers.linear import Linear

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class QuantLinear(ctypes.Structure):  # KvflowQuantLinear
    _fields_ = [("bits", _i64), ("q", _ptr), ("scales", _ptr), ("offsets", _ptr), ("group", _i64), ("layout", _i64)]


class MoE(ctypes.Structure):  # KvflowMoe
    _fields_ = [("num_experts", _i64), ("top_k", _i64), ("intermediate", _i64), ("shared_intermediate", _i64),
                ("norm_topk_prob", _i64), ("round_weights", _i64), ("router", _ptr),
                ("gate_up", ctypes.POINTER(_ptr)), ("down", ctypes.POINTER(_ptr)),
                ("gate_up_q", ctypes.POINTER(ctypes.POINTER(QuantLinear))),
                ("down_q", ctypes.POINTER(ctypes.POINTER(QuantLinear))),
                ("shared_gate_up", _ptr), ("shared_gate_up_q", ctypes.POINTER(QuantLinear)),
                ("shared_down", _ptr), ("shared_down_q", ctypes.POINTER(QuantLinear)), ("shared_gate", _ptr)]


def runs_in_stack(linear: Linear, dtype: torch.dtype) -> bool:
    """Whether C++ can run this layer as the module does: packed for kvflow's GEMM in `dtype`, or
    quantized tiles in a bf16 stack."""
    return ((linear.packing == "kvflow" and linear.packed_weight.dtype == dtype)
            or (linear.packing == "quantized-tiles" and dtype == torch.bfloat16))


def linear_pointers(linear: Linear, keep: list) -> tuple[int | None, ctypes.pointer | None]:
    """(packed weight address, quantized tiles record) of a layer `runs_in_stack` accepts: one of
    them is None. What C++ reads is appended to `keep`, which must outlive the call."""
    tiles = linear.quant_tiles
    if tiles is None:
        keep.append(linear.packed_weight)
        return linear.packed_weight.data_ptr(), None
    record = QuantLinear(bits=tiles.bits, q=tiles.q.data_ptr(), scales=tiles.scales.data_ptr(),
                         offsets=None if tiles.offsets is None else tiles.offsets.data_ptr(), group=tiles.group_size,
                         layout=tiles.layout)
    keep += [tiles, record]
    return None, ctypes.pointer(record)
