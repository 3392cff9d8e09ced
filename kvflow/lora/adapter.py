"""A PEFT LoRA adapter folder, read into kvflow's fused projections.

PEFT saves, per adapted projection, `lora_A` [r, in] and `lora_B` [out, r]; the layer then
computes `base(x) + (x @ A.T) @ B.T * scaling`, with scaling `lora_alpha / r` (or
`lora_alpha / sqrt(r)` with rsLoRA). kvflow's model fuses q/k/v into one `qkv_proj` and
gate/up into one `gate_up_proj`, so an adapter's shards are joined the same way: their A
matrices stacked along the rank ([r_q + r_k + r_v, in]) and their B matrices placed block-
diagonally into the fused output rows, the scaling folded into B. One A and one B matmul per
fused projection then give exactly the sum of the shards' deltas (the off-diagonal blocks are
zeros).

Anything the loader cannot serve exactly is refused with the setting that asks for it: DoRA,
trained biases, `modules_to_save`, adapters on the embedding or the LM head, ranks above
`max_lora_rank`, and tensors whose shapes do not fit the base model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from kvflow.config import ModelConfig
from kvflow.lora.request import LoRARequest

# PEFT's projection name -> (kvflow's fused projection, shard index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(_FUSED) + r")\.lora_([AB])\.weight$")
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass
class LoRAAdapter:
    """One adapter's deltas: (layer index, fused projection) -> (A [R, in], B [out, R]) in float32,
    B already scaled. `rank` is the largest rank of any one shard; `num_parameters` counts the
    checkpoint's A and B (the manager drops `weights` once the layers hold their packed copies)."""

    request: LoRARequest
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    num_parameters: int = 0
    num_projections: int = 0


def shard_rows(cfg: ModelConfig, fused: str) -> list[tuple[int, int]]:
    """(start, size) of each shard's rows in a fused projection's output."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    if fused == "qkv_proj":
        return [(0, q), (q, kv), (q + kv, kv)]
    if fused == "gate_up_proj":
        return [(0, cfg.intermediate_size), (cfg.intermediate_size, cfg.intermediate_size)]
    return [(0, cfg.hidden_size)]


def input_size(cfg: ModelConfig, fused: str) -> int:
    if fused == "o_proj":
        return cfg.num_attention_heads * cfg.head_dim
    return cfg.intermediate_size if fused == "down_proj" else cfg.hidden_size


def read_adapter_config(path: str) -> dict:
    """adapter_config.json, with the settings kvflow cannot serve refused by name."""
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise ValueError(f"lora_path: {path!r} is not a directory (a PEFT adapter folder with adapter_config.json)")
    if not os.path.isfile(config_path):
        raise ValueError(f"lora_path: {path!r} has no adapter_config.json (not a PEFT adapter folder)")
    with open(config_path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora_path: {config_path} is not valid JSON: {exc}") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_path: {path!r} is a {config.get('peft_type')} adapter; only LORA is supported")
    refusals = [
        (config.get("use_dora"), "use_dora: DoRA adapters are not supported"),
        (config.get("bias", "none") != "none", f"bias: {config.get('bias')!r} (trained biases) is not supported; "
                                                 "only 'none'"),
        (config.get("modules_to_save"), "modules_to_save: adapters that replace whole modules are not supported"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out: only Linear layers' [out, in] weights are supported"),
        (config.get("lora_bias"), "lora_bias: adapters with a trained bias on B are not supported"),
        (config.get("alora_invocation_tokens"), "alora_invocation_tokens: activated LoRA (aLoRA) is not supported"),
        (config.get("layer_replication"), "layer_replication: adapters that replicate layers are not supported"),
    ]
    for refused, message in refusals:
        if refused:
            raise ValueError(f"lora_path: {path!r}: {message}")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            try:
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    return load_file(file)
                return torch.load(file, map_location="cpu", weights_only=True)
            except Exception as exc:  # a truncated or foreign file: the request's error, not the server's
                raise ValueError(f"lora_path: {file} could not be read: {exc}") from None
    raise ValueError(f"lora_path: {path!r} has neither {' nor '.join(WEIGHT_FILES)}")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern/alpha_pattern lookup: the first key that matches the module name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check `request.lora_path` against the base model `cfg`; ValueError naming what does not fit."""
    path = request.lora_path
    config = read_adapter_config(path)
    tensors = _read_tensors(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"lora_path: {path!r}: tensor {key!r} is not a LoRA A/B of an attention or MLP "
                             "projection (adapters on the embedding or LM head are not supported)")
        layer, proj, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= cfg.num_hidden_layers:
            raise ValueError(f"lora_path: {path!r}: tensor {key!r} is for layer {layer}, and the base model has "
                             f"{cfg.num_hidden_layers}")
        pairs.setdefault((layer, proj), {})[which] = tensor.float()
    if not pairs:
        raise ValueError(f"lora_path: {path!r} holds no LoRA weights")
    alpha, use_rslora = config.get("lora_alpha", 8), bool(config.get("use_rslora"))  # PEFT's default alpha
    shards: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for (layer, proj), ab in sorted(pairs.items()):
        name = f"layers.{layer}.{proj}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora_path: {path!r}: {name} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        a, b = ab["A"], ab["B"]
        fused, shard = _FUSED[proj]
        start, rows = shard_rows(cfg, fused)[shard]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != input_size(cfg, fused) or b.shape != (rows, r):
            raise ValueError(f"lora_path: {path!r}: {name} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base "
                             f"model needs A [r, {input_size(cfg, fused)}] and B [{rows}, r]")
        if r > max_rank:
            raise ValueError(f"lora_path: {path!r}: rank {r} ({name}) is above max_lora_rank {max_rank}; "
                             f"start the engine with max_lora_rank >= {r}")
        rank = max(rank, r)
        block = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
        module_alpha = _pattern_value(config.get("alpha_pattern"), f"model.layers.{layer}.{block}.{proj}", alpha)
        scaling = module_alpha / (math.sqrt(r) if use_rslora else r)
        shards.setdefault((layer, fused), []).append((shard, a, b * scaling))
    weights = {}
    num_parameters = sum(ab["A"].numel() + ab["B"].numel() for ab in pairs.values())
    for (layer, fused), parts in shards.items():
        total_rank, out = sum(a.shape[0] for _, a, _ in parts), sum(size for _, size in shard_rows(cfg, fused))
        big_a = torch.cat([a for _, a, _ in parts], dim=0)
        big_b = torch.zeros(out, total_rank)
        col = 0
        for shard, a, b in parts:
            start, rows = shard_rows(cfg, fused)[shard]
            big_b[start: start + rows, col: col + a.shape[0]] = b
            col += a.shape[0]
        weights[(layer, fused)] = (big_a, big_b)
    return LoRAAdapter(request, rank, weights, num_parameters, len(weights))
