"""The Llama decoder family: Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2 and Qwen3, and
their mixtures of experts: Mixtral, Qwen2-MoE and Qwen3-MoE.

They differ only in switches read from `ModelConfig`: q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3), rope scaling (Llama 3), tied embeddings, and which layers' MLP is a sparse
mixture of experts (layers/moe.py) instead of one gated MLP. Projections are fused (one QKV
matmul, one gate/up matmul per MLP or expert) and `load_weights` folds the checkpoint's
separate tensors into them.

The forward pass takes one flat batch of tokens from many sequences at once
(`input_ids`, `positions` [num_tokens]) plus the paged KV cache and the step's
attention metadata; it returns hidden states, and `compute_logits` is applied only to the
rows that are sampled.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from kvflow.config import ModelConfig
from kvflow.layers.attention import Attention, AttentionBackend, AttentionMetadata
from kvflow.layers.linear import Linear
from kvflow.layers.mlp import GatedMLP
from kvflow.layers.moe import SparseMoeBlock
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.llama_fused import FusedLlamaStack
from kvflow.quantization.qweight import QuantizedWeight, cat_rows

logger = logging.getLogger("kvflow")


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # Each (token, head) row normed on its own; contiguous, so the CPU kernel takes them
            # (csrc/llama_forward.cpp norms the same rows in place in the fused stack).
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


# Mixtral's names for its MoE tensors -> the names the rest of the family uses
_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def family_name(hf_name: str) -> str:
    """A checkpoint tensor's name as this family spells it: Mixtral's
    `block_sparse_moe.experts.N.w1/w3/w2` become `mlp.experts.N.gate_proj/up_proj/down_proj` (and its
    router `mlp.gate`); every other name is already so. The loader's quantization checks and the
    tensor-parallel slicing read names through this too, so they know one spelling."""
    if ".block_sparse_moe." not in hf_name:
        return hf_name
    for mixtral, ours in _MIXTRAL_NAMES.items():
        hf_name = hf_name.replace(mixtral, ours)
    return hf_name


def build_mlp(cfg: ModelConfig, layer_index: int) -> nn.Module:
    """Layer `layer_index`'s MLP: a sparse mixture of experts where the config routes that layer,
    else one gated MLP."""
    if not cfg.is_moe_layer(layer_index):
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
    return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                          norm_topk_prob=cfg.norm_topk_prob,
                          # transformers rounds the Qwen MoEs' routing weights to the model's dtype, not Mixtral's
                          round_weights=cfg.architecture != "MixtralForCausalLM",
                          shared_intermediate_size=cfg.shared_expert_intermediate_size)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = build_mlp(cfg, layer_index)

    def forward(self, positions, x, residual, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output, not yet added to the residual stream (None for the first layer).

        csrc/llama_forward.cpp runs these same ops in this order for the fused stack: change both.
        """
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard index)
    _STACKED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, backend, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor; loaded under the embedding's name
        self.fused_stack = None  # see fuse_stack()
        # Cleared for a step the fused stack cannot run as is: rows of a LoRA adapter whose A/B it
        # cannot read (lora/manager.py).
        self.use_fused_stack = True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.fused_stack is not None and self.use_fused_stack:
            hidden = self.fused_stack(x, positions, kv_caches, meta)
            if hidden is not None:
                return hidden
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x, residual)[0]

    def fuse_stack(self) -> bool:
        """After the weights are packed: run the decoder stack as one C++ call where every op
        has a kernel (`llama_fused`); the modules stay the path for everything else."""
        self.fused_stack = FusedLlamaStack.build(self)
        return self.fused_stack is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits for the rows that are sampled."""
        return self.lm_head.forward_float32(hidden)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy Hugging Face-named tensors in, folding q/k/v and gate/up into the fused params.

        Every parameter must be written exactly once (fused ones once per shard): a
        checkpoint that misses one fails here, not with garbage output later. A linear
        weight may come as a `QuantizedWeight` (a quantized checkpoint run as shipped): its
        shards are stacked and the layer runs on them (see `_set_quantized`). The embedding
        table may come as one too (a GGUF file's blocks): it is dequantized into the table.
        """
        params = dict(self.named_parameters())
        expected: dict[str, int] = {}
        for name in params:
            expected[name] = 3 if ".qkv_proj.weight" in name or ".qkv_proj.bias" in name else 2 if "gate_up_proj" in name else 1
        seen: dict[str, int] = {}
        quantized: dict[str, dict[int, QuantizedWeight]] = {}
        for hf_name, tensor in weights:
            name = family_name(hf_name).removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                if isinstance(tensor, QuantizedWeight):  # the embedding's own quantized blocks
                    quantized[name] = {0: tensor}
                continue  # tied: the embedding serves as the head
            shard = None
            for part, (fused, idx) in self._STACKED.items():
                if f".{part}." in name:
                    name, shard = name.replace(f".{part}.", f".{fused}."), idx
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}")
            param = params[name]
            if param.device.type == "meta":
                raise RuntimeError(f"{name}: weights were packed and the plain copy released; load weights "
                                   "before pack_linear_weights (load_model does)")
            if shard is None:
                dst = param.data
            else:
                dst = param.data.narrow(0, *self._shard_range(name, shard))
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            if isinstance(tensor, QuantizedWeight) and name == "embed_tokens.weight":
                tensor.dequantize_into(dst)  # the lookup's table (a GGUF file's blocks)
            elif isinstance(tensor, QuantizedWeight):
                quantized.setdefault(name, {})[shard or 0] = tensor
            else:
                dst.copy_(tensor)
            seen[name] = seen.get(name, 0) + 1
        missing = [n for n, count in expected.items() if seen.get(n, 0) < count]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        for name, shards in quantized.items():
            self._set_quantized(name, shards)

    def _set_quantized(self, name: str, shards: dict[int, QuantizedWeight]) -> None:
        """The layer runs on its stacked quantized shards (widened to one format where a file
        mixes types within one fused projection: `cat_rows`)."""
        module = self.get_submodule(name.removesuffix(".weight"))
        if not name.endswith(".weight") or not isinstance(module, Linear):
            raise ValueError(f"checkpoint gives {name!r} quantized, but only linear weights can be")
        ordered = [shards[i] for i in sorted(shards)]
        if any(s.format() != ordered[0].format() for s in ordered):
            logger.info("%s: shards quantized as %s run stacked as int8 (lossless)", name,
                        ", ".join(s.source for s in ordered))
        module.set_quantized(cat_rows(ordered))

    def _shard_range(self, name: str, shard: int) -> tuple[int, int]:
        cfg = self.config
        if "qkv_proj" in name:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        width = self.get_submodule(name.rsplit(".", 2)[0]).intermediate_size  # this MLP's, or this expert's
        return (shard * width, width)
