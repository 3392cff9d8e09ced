"""Maps a checkpoint's `architectures` name to the class that runs it."""

from __future__ import annotations

from torch import nn

from kvflow.config import ModelConfig
from kvflow.layers.attention import AttentionBackend
from kvflow.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def build_model(cfg: ModelConfig, backend: AttentionBackend) -> nn.Module:
    cls = _REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ValueError(
            f"model architecture {cfg.architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    return cls(cfg, backend)
