"""The Llama decoder stack in one C++ call, in bf16 or float32, on CPUs with AVX-512 or AVX2 + FMA.

`LlamaForCausalLM`'s modules run kvflow's CPU kernels one op at a time. At a decode step
each op is microseconds of work behind microseconds of Python (module calls, views,
allocations, ctypes): about 4 ms a step for SmolLM2's 30 layers, a third of a batch-1
step. `FusedLlamaStack` hands the same kernels, in the same order, to
`kvflow_llama_forward` (csrc/llama_forward.cpp) once per step, so its output is bit for
bit the modules' (tests/models/test_llama_fused.py compares them).

It is built once after the weights are packed, and only where every op has its kernel:
weights packed for kvflow's GEMM (bf16 or float32) or quantized weights in its tiles (bf16,
`quantization/tiles.py`), the CPU attention
backend with its kernels, and attention shapes the decode and prefill kernels take. KV caches
in the model's dtype or int8 (`kv_cache_dtype="int8"`: the stack quantizes K/V into them and
runs the int8 attention kernel, as `CPUAttentionBackend._forward_int8` does).
Anything else (other dtypes, other CPUs, KVFLOW_FUSED_STACK=0) keeps the module path, and so
does a step whose tensors don't fit (logged once): `steps_run` / `steps_declined` count both.

The order of ops mirrors `LlamaDecoderLayer.forward`; `build` must refuse any model feature
the C++ does not implement (it lists them: biases outside QKV, a mixture of experts whose
weights csrc/moe.cpp cannot read).

A pipeline stage's model holds a contiguous range of layers, without the embedding before the
first stage or the final norm before the last (`distributed/worker.py` trims them):
`run_stage` runs that range from the previous stage's (x, residual) pair and hands the next
stage the same pair the modules would (`kvflow_llama_stage_forward`).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Protocol

import torch
from torch import nn

from kvflow.config import ModelConfig
from kvflow.layers import cpu_kernels, kv_int8
from kvflow.layers.attention import AttentionMetadata, CPUAttentionBackend
from kvflow.layers.kernel_structs import MoE, QuantLinear, linear_pointers, runs_in_stack
from kvflow.layers.mlp import GatedMLP
from kvflow.layers.moe import SparseMoeBlock
from kvflow.layers.norm import RMSNorm

logger = logging.getLogger("kvflow")
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


_LINEARS = ("qkv", "o_proj", "gate_up", "down")


class _Layer(ctypes.Structure):  # KvflowLlamaLayer
    _fields_ = [*((name, _ptr) for name in (
        "input_norm", "qkv", "qkv_bias", "o_proj", "post_norm", "gate_up", "down", "key_cache", "value_cache")),
        *((f"{name}_q", ctypes.POINTER(QuantLinear)) for name in _LINEARS),
        ("key_scales", _ptr), ("value_scales", _ptr), ("moe", ctypes.POINTER(MoE)), ("q_norm", _ptr), ("k_norm", _ptr)]


class _Shape(ctypes.Structure):  # KvflowLlamaShape
    _fields_ = [*((name, _i64) for name in ("dtype", "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                             "intermediate", "block_size", "max_position")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", _ptr), ("sin", _ptr), ("final_norm", _ptr),
                ("kv_int8", _i64)]


class _LoraProj(ctypes.Structure):  # KvflowLoraProj
    _fields_ = [("a", _ptr), ("b", _ptr), ("rank", _i64)]


class _LoraGroup(ctypes.Structure):  # KvflowLoraGroup
    _fields_ = [("num_rows", _i64), ("rows", _ptr), ("projs", ctypes.POINTER(_LoraProj))]


class _Step(ctypes.Structure):  # KvflowStep
    _fields_ = [("tokens", _i64), ("num_seqs", _i64), ("num_decodes", _i64), ("positions", _ptr),
                ("slot_mapping", _ptr), ("block_tables", _ptr), ("block_table_stride", _i64), ("seq_lens", _ptr),
                ("query_start", _ptr), ("num_lora_groups", _i64), ("lora_groups", ctypes.POINTER(_LoraGroup)),
                ("lora_max_rank", _i64)]


class LoRAProjections:
    """One LoRA adapter's packed A and B (kvflow's GEMM layout, the stack's dtype) and rank for every
    layer and projection (qkv, o_proj, gate_up, down; None: not adapted), as the C++ stack reads
    them (`KvflowLoraProj`). Holds the tensors whose addresses it hands over."""

    def __init__(self, layers: list[list[tuple[torch.Tensor, torch.Tensor, int] | None]]) -> None:
        self.array = (_LoraProj * (4 * len(layers)))()
        self._keep: list[torch.Tensor] = []
        self.max_rank = 0
        for i, projections in enumerate(layers):
            for p, entry in enumerate(projections):
                if entry is not None:
                    a, b, rank = entry
                    self.array[4 * i + p] = _LoraProj(a.data_ptr(), b.data_ptr(), rank)
                    self.max_rank = max(self.max_rank, rank)
                    self._keep += [a, b]


def _stack_dtype(model) -> torch.dtype:
    """The activations' dtype: the embedding's, or the norms' on a stage that has none."""
    if model.embed_tokens is not None:
        return model.embed_tokens.weight.dtype
    return model.layers[0].input_layernorm.weight.dtype


def _int64_ok(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.int64 and t.is_contiguous() for t in tensors)


class LlamaStack(Protocol):
    """What the fused stack reads from a model: `LlamaForCausalLM` is one. llama.py imports
    this module, so it names the attributes rather than that class."""

    config: ModelConfig
    embed_tokens: nn.Embedding
    layers: nn.ModuleList  # of LlamaDecoderLayer
    norm: RMSNorm


class FusedLlamaStack:
    def __init__(self, model: LlamaStack, kernels: cpu_kernels.CPUKernels) -> None:
        cfg = model.config
        attn = model.layers[0].self_attn
        rotary = attn.rotary
        self.dtype = _stack_dtype(model)
        self._fn = kernels.lib.kvflow_llama_stage_forward
        self._fn.argtypes = [ctypes.POINTER(_Shape), ctypes.POINTER(_Layer), ctypes.POINTER(_Step), _ptr, _ptr, _ptr]
        self._fn.restype = ctypes.c_int
        final_norm = model.norm.weight if model.norm is not None else None  # None: a stage before the last
        self.has_final_norm = final_norm is not None
        # Every tensor whose address goes to C++ is held here, so it lives as long as the stack.
        self._keep: list[object] = [rotary.cos_f32, rotary.sin_f32, final_norm]
        self.shape = _Shape(
            dtype=cpu_kernels.DTYPE_CODES[self.dtype], num_layers=len(model.layers), hidden=cfg.hidden_size,
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=cfg.intermediate_size, block_size=0, max_position=rotary.cos_f32.shape[0],
            eps=model.layers[0].input_layernorm.eps, scale=attn.attn.scale, cos=rotary.cos_f32.data_ptr(),
            sin=rotary.sin_f32.data_ptr(), final_norm=final_norm.data_ptr() if final_norm is not None else None)
        self.layers = (_Layer * len(model.layers))()
        for entry, layer in zip(self.layers, model.layers):
            a, mlp = layer.self_attn, layer.mlp
            linears = {"qkv": a.qkv_proj, "o_proj": a.o_proj}
            if isinstance(mlp, SparseMoeBlock):
                entry.moe = ctypes.pointer(mlp.kernel_record())  # the block holds what its record points at
                self._keep.append(mlp)
            else:
                linears |= {"gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
            qkv_bias = a.qkv_proj.packed_bias
            if a.qkv_proj.quant_tiles is not None and a.qkv_proj.bias is not None:
                qkv_bias = a.qkv_proj.bias.detach().to(self.dtype).contiguous()  # as the module's op rounds it
            tensors = {"input_norm": layer.input_layernorm.weight, "qkv_bias": qkv_bias,
                       "post_norm": layer.post_attention_layernorm.weight,
                       "q_norm": a.q_norm.weight if a.q_norm is not None else None,
                       "k_norm": a.k_norm.weight if a.k_norm is not None else None}
            for name, t in tensors.items():
                if t is not None:
                    setattr(entry, name, t.data_ptr())
                    self._keep.append(t)
            for name, m in linears.items():
                weight, quant = linear_pointers(m, self._keep)
                setattr(entry, name, weight)
                setattr(entry, f"{name}_q", quant)
        self._caches: list[torch.Tensor] = []
        self.steps_run = 0
        self.steps_declined = 0
        self._lora: tuple[object, int, list] | None = None  # this step's LoRA groups (set_lora_step)

    def set_lora_step(self, groups: list[tuple[torch.Tensor, LoRAProjections]]) -> None:
        """The next steps' LoRA rows: (rows of the flat batch as a contiguous int64 tensor, that
        adapter's projections) per adapter; empty: the base model on every row."""
        if not groups:
            self._lora = None
            return
        array = (_LoraGroup * len(groups))(*(
            _LoraGroup(rows.numel(), rows.data_ptr(), ctypes.cast(projs.array, ctypes.POINTER(_LoraProj)))
            for rows, projs in groups))
        self._lora = (array, max(projs.max_rank for _, projs in groups), groups)

    @staticmethod
    def build(model: LlamaStack) -> FusedLlamaStack | None:
        """The fused stack when every op of this model has its kernel in the model's dtype, else None."""
        kernels = cpu_kernels.load()
        dtype = _stack_dtype(model)
        if os.environ.get("KVFLOW_FUSED_STACK", "1") == "0" or kernels is None or not kernels.has_gemm(dtype):
            return None
        mlps = [layer.mlp for layer in model.layers]
        if not all(isinstance(m, GatedMLP) or (isinstance(m, SparseMoeBlock) and m.kernel_record() is not None
                                                and m.kernel_dtype == dtype) for m in mlps):
            return None  # a mixture of experts whose weights its C++ block cannot read (layers/moe.py)
        attn = model.layers[0].self_attn
        unbiased = [m for layer in model.layers for m in (layer.self_attn.o_proj, *(
            (layer.mlp.gate_up_proj, layer.mlp.down_proj) if isinstance(layer.mlp, GatedMLP) else ()))]
        linears = unbiased + [layer.self_attn.qkv_proj for layer in model.layers]
        norms = [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm, *(
            (layer.self_attn.q_norm, layer.self_attn.k_norm) if layer.self_attn.q_norm is not None else ()))]
        backends = [layer.self_attn.attn.backend for layer in model.layers]
        fits = (
            all(isinstance(b, CPUAttentionBackend) and b.kernels is not None for b in backends)
            and all(runs_in_stack(m, dtype) for m in linears)
            and all(m.bias is None for m in unbiased)
            and all(n.weight.dtype == dtype and n.weight.is_contiguous()
                    for n in [*norms, *([model.norm] if model.norm is not None else [])])
            and kernels.supports(dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            and kernels.supports_prefill(dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        )
        return FusedLlamaStack(model, kernels) if fits else None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata) -> torch.Tensor | None:
        """Final normed hidden states [T, hidden]; None when this step's tensors don't fit (the
        caller then runs the modules). x (the embeddings) is used as scratch."""
        return self.run_stage(x, None, positions, kv_caches, meta)

    def run_stage(self, residual: torch.Tensor, x_in: torch.Tensor | None, positions: torch.Tensor,
                  kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor | None:
        """This stack's layers from the residual stream (the embeddings on the first stage,
        `x_in` None) and the previous stage's last sublayer output `x_in`. Returns the final
        normed hidden states if the stack has the final norm, else the last sublayer output,
        with `residual` updated in place: the (x, residual) pair the next stage takes. None when
        the step does not fit (the caller runs the modules; `residual` is then untouched)."""
        reason = self._unfit(residual, positions, meta) or (None if self._bind_caches(kv_caches, meta.block_size)
                                                            else "KV caches of another shape or dtype")
        if reason is None and x_in is not None and (x_in.dtype != self.dtype or not x_in.is_contiguous()
                                                     or x_in.shape != residual.shape):
            reason = "the previous stage's activations are not contiguous rows of the residual's shape"
        if reason is not None:
            if self.steps_declined == 0:
                logger.warning("fused Llama stack: step runs on the modules instead (%s)", reason)
            self.steps_declined += 1
            return None
        tables = meta.block_tables
        step = _Step(tokens=residual.shape[0], num_seqs=meta.num_seqs, num_decodes=meta.num_decodes,
                     positions=positions.data_ptr(), slot_mapping=meta.slot_mapping.data_ptr(),
                     block_tables=tables.data_ptr(), block_table_stride=tables.stride(0),
                     seq_lens=meta.seq_lens_tensor.data_ptr(), query_start=meta.query_start_tensor.data_ptr())
        if self._lora is not None:
            array, step.lora_max_rank, _ = self._lora
            step.num_lora_groups, step.lora_groups = len(array), ctypes.cast(array, ctypes.POINTER(_LoraGroup))
        out = torch.empty_like(residual)
        rc = self._fn(ctypes.byref(self.shape), self.layers, ctypes.byref(step), residual.data_ptr(),
                      None if x_in is None else x_in.data_ptr(), out.data_ptr())
        cpu_kernels.check_rc(rc, "fused Llama stack", max_position=self.shape.max_position)
        self.steps_run += 1
        return out

    def _unfit(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> str | None:
        """Why the C++ cannot take this step as it is (it trusts every shape), or None."""
        tokens, num_seqs, nd = x.shape[0], meta.num_seqs, meta.num_decodes
        if x.dtype != self.dtype or not x.is_contiguous() or x.shape[1] != self.shape.hidden:
            return f"activations not contiguous {self.dtype} rows of the hidden size"
        if not _int64_ok(positions, meta.slot_mapping, meta.block_tables, meta.seq_lens_tensor,
                         meta.query_start_tensor):
            return "metadata not contiguous int64"
        if (positions.shape != (tokens,) or meta.slot_mapping.shape != (tokens,)
                or meta.seq_lens_tensor.shape != (num_seqs,) or meta.query_start_tensor.shape != (num_seqs + 1,)
                or meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != num_seqs
                or meta.query_start_loc[-1] != tokens or meta.query_start_loc[nd] != nd):
            return "metadata shapes disagree with the batch"
        return None

    def _bind_caches(self, kv_caches: list, block_size: int) -> bool:
        """Point each layer at its KV cache (tensors in the model's dtype, or int8 caches with
        their scales); the runner passes the same caches every step."""
        if len(kv_caches) == len(self._caches) and all(a is b for a, b in zip(kv_caches, self._caches)):
            return True
        heads = (self.shape.num_kv_heads, self.shape.head_dim)
        int8 = bool(kv_caches) and isinstance(kv_caches[0], kv_int8.Int8KVCache)

        def fits(c) -> bool:
            if int8:
                return (isinstance(c, kv_int8.Int8KVCache) and c.data.dtype == torch.int8 and c.data.is_contiguous()
                        and c.data.shape[0] == 2 and tuple(c.data.shape[2:]) == (block_size, *heads)
                        and c.scales.dtype == torch.float16 and c.scales.is_contiguous()
                        and tuple(c.scales.shape) == (*c.data.shape[:-1],))
            return (isinstance(c, torch.Tensor) and c.dtype == self.dtype and c.is_contiguous()
                    and (c.shape[0], *c.shape[2:]) == (2, block_size, *heads))

        if len(kv_caches) != len(self.layers) or not all(fits(c) for c in kv_caches):
            return False
        if int8 and not kv_int8.kernel_supports(cpu_kernels.load(), self.shape.num_heads, self.shape.num_kv_heads):
            return False
        for entry, cache in zip(self.layers, kv_caches):
            data = cache.data if int8 else cache
            entry.key_cache, entry.value_cache = data[0].data_ptr(), data[1].data_ptr()
            entry.key_scales = cache.scales[0].data_ptr() if int8 else None
            entry.value_scales = cache.scales[1].data_ptr() if int8 else None
        self._caches = list(kv_caches)
        self.shape.block_size = block_size
        self.shape.kv_int8 = int(int8)
        return True
