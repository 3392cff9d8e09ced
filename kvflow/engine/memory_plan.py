"""How much KV cache fits, computed from the shapes instead of guessed.

bytes per token = layers x 2 (K and V) x kv_heads x head_dim x element size; a block holds
`block_size` tokens; the budget is either given in bytes (`kv_cache_memory`) or a fraction
of the machine's memory (`memory_utilization`) minus the weights and the activation peak.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from kvflow.config import ModelConfig
from kvflow.device import DEFAULT_GPU_MEMORY_UTILIZATION
from kvflow.quantization.config import QuantizationConfig

# 512 MiB: 23,000 tokens of SmolLM2 in bf16 (2.8 sequences at its full 8,192 context, 32 at
# W-offline's lengths with room to spare), and peak RSS on W-offline stays under 1.5 GB.
# A model whose one full-length sequence needs more gets that much instead.
DEFAULT_KV_CACHE_MEMORY = 512 << 20


@dataclass
class KVCachePlan:
    dtype: torch.dtype
    block_size: int
    bytes_per_token: int
    num_blocks: int
    max_model_len: int
    weight_bytes: int
    # Speculative decoding with a draft model: its KV cache holds as many tokens as the
    # target's and comes out of the same budget.
    draft_bytes_per_token: int = 0
    draft_weight_bytes: int = 0
    weight_format: str = "none"  # the linear layers' quantization (QuantizationConfig.describe)
    kv_cache_dtype: str = "auto"  # "auto" (= dtype) or "int8"
    # Bytes per token of each KV cache dtype this model could use, for the comparison rows.
    bytes_per_token_by_kv_dtype: dict[str, int] = field(default_factory=dict)
    draft_shares_kv: bool = False  # a self-draft runs on the target's cache (spec_decode/draft_model.py)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many sequences of `max_model_len` tokens fit at once."""
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        return self.num_blocks / blocks_per_seq

    @property
    def kv_dtype_name(self) -> str:
        return _dtype_name(self.dtype) if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def describe(self) -> str:
        rows = [
            ("dtype", _dtype_name(self.dtype)),
            ("weights", _fmt_bytes(self.weight_bytes)),
            ("quantization", self.weight_format),
            ("KV cache dtype", self.kv_dtype_name),
            ("KV bytes per token", f"{self.bytes_per_token:,} B"),
            ("block size", f"{self.block_size} tokens ({_fmt_bytes(self.bytes_per_block)})"),
            ("KV cache", f"{_fmt_bytes(self.kv_cache_bytes)} = {self.num_blocks:,} blocks = {self.num_tokens:,} tokens"),
            *([("draft weights", _fmt_bytes(self.draft_weight_bytes)),
               ("draft KV per token", f"{self.draft_bytes_per_token:,} B"),
               ("draft KV cache", f"{_fmt_bytes(self.draft_bytes_per_token * self.num_tokens)} "
                                  f"(the same {self.num_tokens:,} tokens)")] if self.draft_bytes_per_token else []),
            *([("draft weights", _fmt_bytes(self.draft_weight_bytes)),
               ("draft KV cache", "the target's (a self-draft reads and writes the target's K/V)")]
              if self.draft_shares_kv else []),
            ("max model len", f"{self.max_model_len:,} tokens"),
            ("max concurrency", f"{self.max_concurrency:.2f} sequences at max model len"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join([*(f"  {k:<{width}}  {v}" for k, v in rows), *self._kv_dtype_rows()])

    def _kv_dtype_rows(self) -> list[str]:
        """What the same KV memory holds in each KV cache dtype (--kv-cache-dtype)."""
        if len(self.bytes_per_token_by_kv_dtype) < 2:
            return []
        budget = self.kv_cache_bytes + self.draft_bytes_per_token * self.num_tokens
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        lines = ["", f"  in the same {_fmt_bytes(budget)} of KV memory, by --kv-cache-dtype:",
                 f"    {'KV dtype':<10} {'bytes/token':>11} {'tokens':>11} {'max concurrency':>16}"]
        for name, bpt in self.bytes_per_token_by_kv_dtype.items():
            blocks = budget // ((bpt + self.draft_bytes_per_token) * self.block_size)
            mark = "  <- this plan" if bpt == self.bytes_per_token and name == self.kv_dtype_name else ""
            lines.append(f"    {name:<10} {bpt:>11,} {blocks * self.block_size:>11,} "
                         f"{blocks / blocks_per_seq:>16.2f}{mark}")
        return lines


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def system_memory_bytes() -> int:
    """Total memory this process may use: the machine's, or its cgroup limit if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def _device_budget(device_memory: tuple[int, int], kv_cache_memory: int | None, utilization: float | None,
                   weight_bytes: int, activation_bytes: int) -> tuple[int, str]:
    """The KV budget on a GPU with (free, total) bytes, and the setting it came from."""
    free, total = device_memory
    others = weight_bytes + activation_bytes
    if kv_cache_memory is not None:
        if kv_cache_memory + others > free:
            raise ValueError(
                f"kv_cache_memory={kv_cache_memory} ({_fmt_bytes(kv_cache_memory)}) with {_fmt_bytes(weight_bytes)} "
                f"of weights and {_fmt_bytes(activation_bytes)} of activations exceeds the GPU's free memory "
                f"({_fmt_bytes(free)} of {_fmt_bytes(total)}): lower kv_cache_memory, or leave it unset to take "
                f"gpu_memory_utilization ({DEFAULT_GPU_MEMORY_UTILIZATION}) of the GPU")
        return int(kv_cache_memory), f"kv_cache_memory={kv_cache_memory}"
    utilization = DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    in_use = total - free  # other processes, and this one's CUDA context
    return int(utilization * total) - in_use - others, f"gpu_memory_utilization={utilization}"


def cuda_activation_bytes(cfg: ModelConfig, dtype: torch.dtype, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """What a step needs on the GPU beside weights and KV: twice the largest per-token
    intermediates of a full token budget (QKV, gate/up, the residual stream), float32 logits of
    every sampled row and a copy, and 1 GiB for cuBLAS workspaces, CUDA graph pools and the
    allocator's slack."""
    elem = torch.tensor([], dtype=dtype).element_size()
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    mlp = max(cfg.intermediate_size, cfg.num_experts_per_tok * cfg.moe_intermediate_size
              + cfg.shared_expert_intermediate_size)  # a token's gate/up rows, all its experts'
    per_token = (4 * cfg.hidden_size + 2 * mlp + qkv) * elem
    return 2 * max_num_batched_tokens * per_token + 2 * max_num_seqs * cfg.vocab_size * 4 + (1 << 30)


def device_memory_inputs(device: torch.device, cfg: ModelConfig, dtype: torch.dtype, max_num_batched_tokens: int,
                         max_num_seqs: int, device_memory: int | None = None) -> tuple[tuple[int, int] | None, int]:
    """(free, total) GPU bytes and the activation reserve for `plan_kv_cache`: (None, 0) on the
    CPU; `device_memory` names a GPU of that size that need not be present (kvflow plan)."""
    if device_memory is not None:
        memory = (device_memory, device_memory)
    elif device.type == "cuda":
        from kvflow.device import cuda_memory

        memory = cuda_memory(device)
    else:
        return None, 0
    return memory, cuda_activation_bytes(cfg, dtype, max_num_batched_tokens, max_num_seqs)


def plan_kv_cache(
    cfg: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    kv_cache_memory: int | None = None,
    memory_utilization: float | None = None,
    activation_bytes: int = 0,
    draft: ModelConfig | None = None,
    draft_shares_kv: bool = False,
    quantization: QuantizationConfig | None = None,
    kv_cache_dtype: str = "auto",
    device_memory: tuple[int, int] | None = None,
    gpu_memory_utilization: float | None = None,
) -> KVCachePlan:
    """`draft`: a speculative draft model, whose weights and KV cache (as many tokens as the
    target's) come out of the same budget; with `draft_shares_kv` (a self-draft on the target's
    cache) only its weights. `quantization`: the linear weights' format (the embedding and LM
    head stay in `dtype`; a quantized head is not counted as smaller).
    `kv_cache_dtype`: the target's KV storage ("auto" or "int8"; a draft keeps `dtype`).
    `device_memory`: (free, total) bytes of the GPU the pool goes on (None: the CPU); there the
    default budget is `gpu_memory_utilization` (0.9) of the total, less what is already in use,
    the weights and `activation_bytes`, and a `kv_cache_memory` that does not fit is refused."""
    if kv_cache_memory is not None and memory_utilization is not None:
        raise ValueError("kv_cache_memory and memory_utilization: set one, not both")
    if gpu_memory_utilization is not None and device_memory is None:
        raise ValueError("gpu_memory_utilization applies to --device cuda (or kvflow plan --device-memory); "
                         "on the CPU use memory_utilization or kv_cache_memory")
    if device_memory is not None and memory_utilization is not None:
        raise ValueError("memory_utilization is a share of host memory (the CPU backend's setting); "
                         "on a GPU set gpu_memory_utilization or kv_cache_memory")
    if gpu_memory_utilization is not None and kv_cache_memory is not None:
        raise ValueError("kv_cache_memory and gpu_memory_utilization: set one, not both")
    elem = torch.tensor([], dtype=dtype).element_size()
    weight_bytes = cfg.num_parameters() * elem
    if quantization is not None:
        weight_bytes += quantization.weight_bytes_delta(cfg, elem)
    bytes_per_token = cfg.kv_bytes_per_token(dtype, kv_cache_dtype)
    by_kv_dtype = {_dtype_name(dtype): cfg.kv_bytes_per_token(dtype)}
    if cfg.head_dim % 4 == 0 and device_memory is None:  # (CPU only) what the int8 cache's key cells need
        by_kv_dtype["int8"] = cfg.kv_bytes_per_token(dtype, "int8")
    draft_bpt = draft.kv_bytes_per_token(dtype) if draft is not None and not draft_shares_kv else 0
    draft_weights = draft.num_parameters() * elem if draft is not None else 0
    one_sequence = -(-max_model_len // block_size) * block_size * (bytes_per_token + draft_bpt)
    if device_memory is not None:
        budget, source = _device_budget(device_memory, kv_cache_memory, gpu_memory_utilization,
                                        weight_bytes + draft_weights, activation_bytes)
    elif memory_utilization is not None:
        if not 0 < memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
        budget = int(memory_utilization * system_memory_bytes()) - weight_bytes - draft_weights - activation_bytes
        source = f"memory_utilization={memory_utilization}"
    else:
        budget = max(DEFAULT_KV_CACHE_MEMORY, one_sequence) if kv_cache_memory is None else int(kv_cache_memory)
        source = f"kv_cache_memory={budget}"
    if budget <= 0:
        draft_note = f" and {_fmt_bytes(draft_weights)} of draft weights" if draft is not None else ""
        raise ValueError(f"{source} leaves no memory for the KV cache after {_fmt_bytes(weight_bytes)} of weights"
                         f"{draft_note}")
    num_blocks = budget // ((bytes_per_token + draft_bpt) * block_size)
    plan = KVCachePlan(dtype, block_size, bytes_per_token, num_blocks, max_model_len, weight_bytes, draft_bpt,
                       draft_weights, quantization.describe() if quantization is not None else "none",
                       kv_cache_dtype, by_kv_dtype, draft_shares_kv=draft is not None and draft_shares_kv)
    if plan.num_tokens < max_model_len:
        need = one_sequence
        whose = " with the draft model's (speculative_config.model) beside it" if draft is not None else ""
        raise ValueError(
            f"the KV cache ({source}){whose} holds {plan.num_tokens:,} tokens, fewer than one sequence of "
            f"max_model_len={max_model_len:,}: raise kv_cache_memory to at least {need:,} bytes "
            f"({_fmt_bytes(need)}) or lower max_model_len"
        )
    return plan
