"""Mixtures of experts in GGUF files (Mixtral, Qwen2-MoE, Qwen3-MoE as llama.cpp converts them).

llama.cpp stacks a layer's experts into one 3-D tensor per projection (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`: [experts, rows, inputs] in torch order), each expert's rows
one contiguous run of blocks. `expert_parts` cuts such a tensor into the experts' own 2-D
weights under their Hugging Face names, so the loader runs each as shipped (or dequantizes
it) exactly like a dense projection. The routers and Qwen2-MoE's shared expert are plain
tensors with names of their own (`BLOCK_NAMES`).
"""

from __future__ import annotations

import re
from typing import Any, Callable

# GGUF block tensor -> the HF module it fills
BLOCK_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # stored 1-D: [hidden]
}
_STACKED = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
# llama.cpp's MoE architectures -> the HF class; Mixtral's files say "llama" (with an expert count)
ARCHITECTURES = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "llama": "MixtralForCausalLM"}


def expert_parts(name: str, shape: tuple[int, ...], nbytes: int) -> list[tuple[str, tuple[int, int], int]] | None:
    """(HF name, 2-D shape, byte offset within the tensor) of each expert in a stacked expert
    tensor; None for any other tensor."""
    m = _STACKED.fullmatch(name)
    if m is None:
        return None
    if len(shape) != 3:
        raise ValueError(f"GGUF tensor {name!r} has shape {shape}; stacked experts are 3-D")
    experts, rows, cols = shape
    per_expert = nbytes // experts
    layer, proj = m.group(1), m.group(2)
    return [(f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight", (rows, cols), e * per_expert)
            for e in range(experts)]


def moe_config(get: Callable[[str, Any], Any], arch: str, shapes: dict[str, tuple[int, ...]], num_layers: int,
               ffn: int) -> dict[str, Any]:
    """The config.json keys of a mixture of experts, from the file's `{arch}.expert_*` metadata;
    layers without a router (`ffn_gate_inp`) are dense (Qwen2-MoE's `mlp_only_layers`)."""
    shared = get("expert_shared_feed_forward_length", 0)
    return {
        "architectures": [ARCHITECTURES[arch]],
        "num_experts": int(get("expert_count", 0)),
        "num_experts_per_tok": int(get("expert_used_count", 0)),
        "moe_intermediate_size": int(get("expert_feed_forward_length", ffn)),
        "shared_expert_intermediate_size": int(shared or 0),
        # llama.cpp renormalises the top-k weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE
        "norm_topk_prob": arch != "qwen2moe",
        "mlp_only_layers": [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes],
    }
