"""`QuantizationConfig`: which weights are stored as integers, and how.

`quantization` takes vLLM's option name and these values:
  - None (the default): a GGUF file runs on its own quantized weights when `dtype` is "auto"
    (the file was made to run that way, and dequantizing it to bf16 doubles or quadruples the
    bytes every decode step streams); anything else runs unquantized;
  - "none": no quantization, a GGUF file's weights dequantized to `dtype` (the fp32 reference);
  - "int8": per-output-channel symmetric int8, quantized at load;
  - "int4": 4-bit with a float scale and zero point per group of `quantization_group_size`
    inputs (32 by default), quantized at load;
  - "gguf": a GGUF file's Q8_0 / Q4_0 / Q4_1 weights as shipped;
  - "compressed-tensors": a Hugging Face checkpoint's compressed-tensors W4A16 / W8A16 weights
    as shipped (the default for such a checkpoint, whatever `dtype`: it has no float weights);
  - "gptq": a Hugging Face checkpoint's GPTQ-format 4-/8-bit weights (qweight, qzeros, scales,
    g_idx) as shipped, the default for such a checkpoint likewise.
Activations stay in `dtype`; the embedding and the LM head keep it too unless
`quantize_lm_head` (then the head alone is quantized, the embedding table stays).
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("none", "int8", "int4", "gguf", "compressed-tensors", "gptq")
SHIPPED = ("gguf", "compressed-tensors", "gptq")  # the checkpoint fixes the format; nothing is quantized at load
HF_SHIPPED = ("compressed-tensors", "gptq")  # formats of a Hugging Face checkpoint's config.json
# What kvflow holds per weight for each GGUF type (the K-quants' 5- and 6-bit values take a
# byte, and every sub-block a float32 scale and offset).
GGUF_BYTES_PER_WEIGHT = {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q4_K": 0.5 + 8 / 32,
                         "Q5_K": 1 + 8 / 32, "Q6_K": 1 + 4 / 16}
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_INT4_GROUP_SIZE = 32


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # "int8" | "int4" | "gguf" | "compressed-tensors" | "gptq"
    group_size: int | None  # int8: None = one group per output channel; int4: inputs per group
    quantize_lm_head: bool = False
    gguf_type: str | None = None  # gguf: the type most of the file's linear weights ship in
    bits: int | None = None  # compressed-tensors, gptq: the checkpoint's (smallest) weight width

    @staticmethod
    def parse(method: str | None, group_size: int | None = None, quantize_lm_head: bool = False) -> QuantizationConfig | None:
        """The config the options ask for; None for no quantization. Every bad value is refused
        with the option's name and the supported values."""
        if method is None or method == "none":
            if group_size is not None:
                raise ValueError("quantization_group_size is set but quantization is not (choose int8 or int4)")
            return None
        if method not in METHODS:
            raise ValueError(f"quantization: {method!r} is not supported; choose one of {', '.join(METHODS)} "
                             "(or leave it unset: a GGUF file then runs on its own quantization)")
        if group_size is not None:
            if method in SHIPPED:
                raise ValueError(f"quantization_group_size does not apply to {method}: the checkpoint fixes it")
            if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 8:
                raise ValueError(f"quantization_group_size must be an integer >= 8, got {group_size!r}")
            if method == "int4" and group_size % 32:
                raise ValueError(f"quantization_group_size: int4 groups are whole 32-input blocks "
                                 f"(e.g. {', '.join(map(str, INT4_GROUP_SIZES))}), got {group_size}")
            if method == "int8" and group_size % 8:
                raise ValueError(f"quantization_group_size: int8 groups are multiples of 8 inputs, got {group_size}")
        elif method == "int4":
            group_size = DEFAULT_INT4_GROUP_SIZE
        return QuantizationConfig(method, group_size, bool(quantize_lm_head))

    def bytes_per_weight(self) -> float:
        """Bytes a quantized linear weight takes, scales and offsets included (for memory plans)."""
        if self.method == "gguf":
            return GGUF_BYTES_PER_WEIGHT.get(self.gguf_type or "Q4_1", 1.0)
        if self.method in HF_SHIPPED:  # quants, a float32 scale and offset per group
            return (self.bits or 8) / 8 + (8 / self.group_size if self.group_size else 0.0)
        if self.method == "int8":
            return 1.0 + (4 / self.group_size if self.group_size else 0.0)
        return 0.5 + 8 / (self.group_size or DEFAULT_INT4_GROUP_SIZE)

    def describe(self) -> str:
        if self.method == "gguf":
            return f"gguf ({self.gguf_type or 'as shipped'}, as shipped)"
        if self.method in HF_SHIPPED:
            group = f"groups of {self.group_size}" if self.group_size else "per channel"
            return f"{self.method} (W{self.bits}A16, {group}, as shipped)"
        group = f"groups of {self.group_size}" if self.group_size else "per channel"
        return f"{self.method} ({group}{', LM head too' if self.quantize_lm_head else ''})"

    def weight_bytes_delta(self, model_config, elem: int, head: bool = True) -> int:
        """How quantization changes a model's weight bytes from all-float (`elem` bytes each): its
        decoder's linear weights at `bytes_per_weight`, and with `quantize_lm_head` (when `head`:
        the rank holds it) a quantized head; a head tied to the embedding is untied by it, so the
        float table stays beside it."""
        linear = model_config.num_linear_parameters()
        delta = int(linear * self.bytes_per_weight()) - linear * elem
        if head and self.quantize_lm_head:
            params = model_config.vocab_size * model_config.hidden_size
            delta += int(params * self.bytes_per_weight()) - (0 if model_config.tie_word_embeddings else params * elem)
        return delta

    def check_model(self, model_config) -> None:
        """`check_layer` over a model's linear input sizes from its config alone (`kvflow plan`,
        which loads no weights); the formats quantized at load only."""
        if self.method in ("int8", "int4"):
            for name, in_features in model_config.linear_input_sizes().items():
                self.check_layer(name, in_features)

    def check_layer(self, name: str, in_features: int) -> None:
        """Refuse a layer whose input size the kernel cannot split into this config's groups."""
        group = self.group_size or in_features
        block = 32 if self.method == "int4" else 8
        if in_features % group or group % block:
            raise ValueError(f"quantization_group_size={self.group_size}: layer {name} has {in_features} inputs, "
                             f"which are not whole groups of {group} (groups must be multiples of {block})")
